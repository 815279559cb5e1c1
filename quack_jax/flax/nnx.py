"""``RMSNorm`` and ``LayerNorm`` for ``flax.nnx``, running quack_jax where they can."""

from __future__ import annotations

from flax import nnx

from .linen import _norm, _supported


def _value(param):
    return None if param is None else param[...]


class RMSNorm(nnx.RMSNorm):
    """``flax.nnx.RMSNorm`` computed by :func:`quack_jax.rms_norm` where it can be."""

    def __call__(self, x, mask=None):
        px, scale = self.promote_dtype((x, _value(self.scale)), dtype=self.dtype)
        dtypes = [p.dtype for p in (scale,) if p is not None]
        if mask is not None or not _supported(px, self.dtype, dtypes, self):
            return super().__call__(x, mask)
        return _norm(px, scale, None, rms=True, epsilon=self.epsilon, dtype=self.dtype)


class LayerNorm(nnx.LayerNorm):
    """``flax.nnx.LayerNorm`` computed by :func:`quack_jax.layer_norm` where it can be."""

    def __call__(self, x, *, mask=None):
        px, scale, bias = self.promote_dtype(
            (x, _value(self.scale), _value(self.bias)), dtype=self.dtype
        )
        dtypes = [p.dtype for p in (scale, bias) if p is not None]
        if mask is not None or not _supported(px, self.dtype, dtypes, self):
            return super().__call__(x, mask=mask)
        return _norm(px, scale, bias, rms=False, epsilon=self.epsilon, dtype=self.dtype)
