"""``RMSNorm`` and ``LayerNorm`` for ``flax.linen``, running quack_jax where they can, and
LM heads whose cross-entropy runs without the logits (``DenseCrossEntropy``,
``embed_cross_entropy``)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.linen.dtypes import canonicalize_dtype

from ._common import _computes, _default_dot_general, _flax_norm, _head_loss, _norm


class RMSNorm(nn.RMSNorm):
    """``flax.linen.RMSNorm`` computed by :func:`quack_jax.rms_norm` where it can be.

    ``residual=``: an array added to ``x`` first; the call then returns
    ``(norm(x + residual), x + residual)``, a pre-norm block's norm and residual stream.
    Where ``residual`` has x's shape and dtype, quack_jax adds them in the norm's
    kernel, and its backward adds the stream's cotangent to the norm's gradient in the
    same pass.
    """

    @nn.compact
    def __call__(self, x, *, mask=None, residual=None):
        if not _computes(self, x, x, [self.param_dtype], mask, residual):
            return _flax_norm(functools.partial(super().__call__, mask=mask), x, residual)
        features = [x.shape[-1]]  # a list, as Flax hands it to the initializers
        scale = None
        if self.use_scale:
            scale = self.param("scale", self.scale_init, features, self.param_dtype)
        out = canonicalize_dtype(x, scale, dtype=self.dtype)
        return _norm(x, scale, None, out, rms=True, epsilon=self.epsilon, residual=residual)


class LayerNorm(nn.LayerNorm):
    """``flax.linen.LayerNorm`` computed by :func:`quack_jax.layer_norm` where it can be.

    ``residual=`` as for :class:`RMSNorm`.
    """

    @nn.compact
    def __call__(self, x, *, mask=None, residual=None):
        if not _computes(self, x, x, [self.param_dtype], mask, residual):
            return _flax_norm(functools.partial(super().__call__, mask=mask), x, residual)
        features = [x.shape[-1]]  # a list, as Flax hands it to the initializers
        scale = bias = None
        if self.use_scale:
            scale = self.param("scale", self.scale_init, features, self.param_dtype)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, features, self.param_dtype)
        out = canonicalize_dtype(x, scale, bias, dtype=self.dtype)
        return _norm(x, scale, bias, out, rms=False, epsilon=self.epsilon, residual=residual)


# -- the LM head and its cross-entropy, without the logits --------------------------------


class DenseCrossEntropy(nn.Dense):
    """A ``flax.linen.Dense`` LM head and the cross-entropy of its logits, computed by
    :func:`quack_jax.linear_cross_entropy` without making the logits.

    The same fields, parameters (``kernel`` (d, features), ``bias`` (features,)),
    initialisers and dtype promotion as ``Dense``: name it as the ``Dense`` head was
    (``DenseCrossEntropy(vocab, name="lm_head")``) and that head's checkpoint loads
    unchanged. ``__call__(inputs, labels, **kwargs)`` returns
    ``quack_jax.cross_entropy(Dense(...)(inputs), labels, **kwargs)``; ``kwargs`` are
    ``linear_cross_entropy``'s loss options (``reduction``, ``ignore_index``,
    ``label_smoothing``, ``z_loss``, ``logit_softcap``, ``return_lse``, ``chunk_size``).
    The GEMMs run at the module's ``precision``; a ``dot_general`` or
    ``dot_general_cls`` other than ``lax.dot_general`` raises ``ValueError``.
    """

    @nn.compact
    def __call__(self, inputs, labels, **kwargs):
        fn = "DenseCrossEntropy"
        if self.dot_general_cls is not None or not _default_dot_general(self.dot_general):
            raise ValueError(
                f"{fn}: a dot_general or dot_general_cls other than lax.dot_general is not "
                "supported (linear_cross_entropy makes the logits with lax.dot_general)"
            )
        if np.ndim(inputs) < 1:
            raise ValueError(f"{fn}: the inputs must have shape (..., d), got a scalar")
        kernel = self.param(
            "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
        )
        bias = None
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        what = "the Dense head"
        return _head_loss(
            fn, what, inputs, kernel, labels, kwargs, bias=bias, precision=self.precision
        )


def embed_cross_entropy(embed: nn.Embed, x, labels, **kwargs):
    """``quack_jax.cross_entropy(embed.attend(x), labels, **kwargs)`` for a bound
    ``flax.linen.Embed`` (a tied LM head), by :func:`quack_jax.linear_cross_entropy` on
    its ``embedding`` table (V, d) without a transposed copy and without the logits.

    ``x`` and the table are promoted as ``attend`` promotes them (``embed.promote_dtype``
    with ``dtype=embed.dtype``); the GEMMs run at the default precision, as ``attend``'s
    ``jnp.dot``. ``kwargs`` are ``linear_cross_entropy``'s loss options (``reduction``,
    ``ignore_index``, ``label_smoothing``, ``z_loss``, ``logit_softcap``, ``return_lse``,
    ``chunk_size``). Call it where ``embed`` is bound: inside the parent module's method,
    or on ``embed.bind(variables)``.
    """
    fn = "embed_cross_entropy"
    if not isinstance(embed, nn.Embed):
        raise ValueError(f"{fn}: embed must be a flax.linen.Embed, got {type(embed).__name__}")
    if type(embed).attend is not nn.Embed.attend:
        raise ValueError(
            f"{fn}: {type(embed).__name__} overrides Embed.attend, whose logits "
            "linear_cross_entropy cannot know"
        )
    if embed.scope is None:
        raise ValueError(
            f"{fn}: the Embed module is unbound; call it inside the parent module's method "
            "or on embed.bind(variables)"
        )
    x, table = embed.promote_dtype(x, embed.embedding, dtype=embed.dtype)
    return _head_loss(fn, "the Embed table", x, table, labels, kwargs, transpose=True)
