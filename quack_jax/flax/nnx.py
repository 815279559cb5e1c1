"""``RMSNorm`` and ``LayerNorm`` for ``flax.nnx``, running quack_jax where they can, and
``linear_cross_entropy`` of an ``nnx.Linear`` or tied ``nnx.Embed`` LM head without the
logits."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.dtypes import canonicalize_dtype

from ._common import _FLOATS, _computes, _default_dot_general, _flax_norm, _head_loss, _norm


def _value(param):
    return None if param is None else param[...]


class RMSNorm(nnx.RMSNorm):
    """``flax.nnx.RMSNorm`` computed by :func:`quack_jax.rms_norm` where it can be.

    ``residual=``: an array added to ``x`` first; the call then returns
    ``(norm(x + residual), x + residual)``, a pre-norm block's norm and residual stream.
    Where ``residual`` has x's shape and dtype, and the module's promotion (to its
    ``dtype``, or without one to x's and the parameters' common dtype) leaves x's dtype,
    quack_jax adds them in the norm's kernel, and its backward adds the stream's
    cotangent to the norm's gradient in the same pass.
    """

    def __call__(self, x, mask=None, *, residual=None):
        px, scale = self.promote_dtype((x, _value(self.scale)), dtype=self.dtype)
        dtypes = [p.dtype for p in (scale,) if p is not None]
        if not _computes(self, x, px, dtypes, mask, residual):
            return _flax_norm(functools.partial(super().__call__, mask=mask), x, residual)
        out = canonicalize_dtype(px, scale, dtype=self.dtype)
        return _norm(px, scale, None, out, rms=True, epsilon=self.epsilon, residual=residual)


class LayerNorm(nnx.LayerNorm):
    """``flax.nnx.LayerNorm`` computed by :func:`quack_jax.layer_norm` where it can be.

    ``residual=`` as for :class:`RMSNorm`.
    """

    def __call__(self, x, *, mask=None, residual=None):
        px, scale, bias = self.promote_dtype(
            (x, _value(self.scale), _value(self.bias)), dtype=self.dtype
        )
        dtypes = [p.dtype for p in (scale, bias) if p is not None]
        if not _computes(self, x, px, dtypes, mask, residual):
            return _flax_norm(functools.partial(super().__call__, mask=mask), x, residual)
        out = canonicalize_dtype(px, scale, bias, dtype=self.dtype)
        return _norm(px, scale, bias, out, rms=False, epsilon=self.epsilon, residual=residual)


def linear_cross_entropy(module: nnx.Linear | nnx.Embed, x, labels, **kwargs):
    """``quack_jax.cross_entropy`` of an LM head's logits, by
    :func:`quack_jax.linear_cross_entropy` without making them.

    ``module`` is the head: an ``nnx.Linear`` (logits ``module(x)``: its kernel (d, V)
    and optional bias, at its ``precision`` and ``preferred_element_type``) or an
    ``nnx.Embed`` (a tied head, logits ``module.attend(x)``: its ``embedding`` (V, d)
    used without a transposed copy, at the default precision). ``x`` and the parameters
    are promoted as the module promotes them (``module.promote_dtype`` with
    ``dtype=module.dtype``). ``kwargs`` are ``linear_cross_entropy``'s loss options
    (``reduction``, ``ignore_index``, ``label_smoothing``, ``z_loss``, ``logit_softcap``,
    ``return_lse``, ``chunk_size``).

    Raises ``ValueError`` for a head whose logits it would compute differently: another
    module type, a subclass that overrides ``__call__`` (``Linear``, e.g. ``LoRALinear``)
    or ``attend`` (``Embed``), a ``dot_general`` other than ``lax.dot_general``, a
    ``preferred_element_type`` that is not a floating dtype or that the bias would widen,
    or ``x`` not of shape (..., d).

    Example (an untied head)::

        loss = qnnx.linear_cross_entropy(model.lm_head, h, targets)
    """
    fn = "quack_jax.flax.nnx.linear_cross_entropy"
    if isinstance(module, nnx.Linear):
        what = f"the {type(module).__name__} head"
        if type(module).__call__ is not nnx.Linear.__call__:
            raise ValueError(
                f"{fn}: {type(module).__name__} overrides Linear.__call__, whose logits "
                "linear_cross_entropy cannot know"
            )
        if not _default_dot_general(getattr(module, "dot_general", None)):
            raise ValueError(
                f"{fn}: {what} has a dot_general other than lax.dot_general, which "
                "linear_cross_entropy cannot use"
            )
        kernel, bias = _value(module.kernel), _value(module.bias)
        x, kernel, bias = module.promote_dtype((x, kernel, bias), dtype=module.dtype)
        preferred = getattr(module, "preferred_element_type", None)
        if preferred is not None:
            name = jnp.dtype(preferred).name
            widened = bias is not None and jnp.promote_types(name, bias.dtype).name != name
            if name not in _FLOATS or widened:
                raise ValueError(
                    f"{fn}: {what} has preferred_element_type {name}, which "
                    "linear_cross_entropy does not reproduce (it takes a floating dtype "
                    "at least as wide as the bias's)"
                )
        return _head_loss(
            fn,
            what,
            x,
            kernel,
            labels,
            kwargs,
            bias=bias,
            precision=module.precision,
            preferred_element_type=preferred,
        )
    if isinstance(module, nnx.Embed):
        if type(module).attend is not nnx.Embed.attend:
            raise ValueError(
                f"{fn}: {type(module).__name__} overrides Embed.attend, whose logits "
                "linear_cross_entropy cannot know"
            )
        x, table = module.promote_dtype((x, _value(module.embedding)), dtype=module.dtype)
        what = "the tied Embed head"
        return _head_loss(fn, what, x, table, labels, kwargs, transpose=True)
    raise ValueError(
        f"{fn}: module must be an nnx.Linear or an nnx.Embed (a tied head), "
        f"got {type(module).__name__}"
    )
