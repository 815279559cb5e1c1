"""``RMSNorm`` and ``LayerNorm`` for ``flax.linen``, running quack_jax where they can, and
LM heads whose cross-entropy runs without the logits (``DenseCrossEntropy``,
``embed_cross_entropy``)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.linen.dtypes import canonicalize_dtype
from jax import lax

import quack_jax

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _axes(ndim, axes):
    axes = axes if isinstance(axes, Iterable) else (axes,)
    return {ndim + a if a < 0 else a for a in axes}


def _supported(x, dtype, param_dtypes, norm) -> bool:
    """Whether quack_jax computes ``norm`` (a Flax norm module) of ``x`` as Flax would.

    Flax's math is in ``x``'s dtype promoted with float32, ``dtype`` and ``param_dtypes``;
    quack_jax's in ``x``'s promoted with float32 only, so the others may not ask for more.
    """
    x_dtype = getattr(x, "dtype", None)
    if x_dtype is None or jnp.dtype(x_dtype).name not in _FLOATS or np.ndim(x) == 0:
        return False
    if dtype is not None and jnp.dtype(dtype).name not in _FLOATS:
        return False
    last = {np.ndim(x) - 1}
    eps = norm.epsilon
    compute = jnp.promote_types(x_dtype, jnp.float32)
    return (
        getattr(norm, "force_float32_reductions", True)
        and norm.axis_name is None
        and norm.axis_index_groups is None
        and _axes(np.ndim(x), norm.reduction_axes) == last
        and _axes(np.ndim(x), norm.feature_axes) == last
        and isinstance(eps, numbers.Real)
        and not isinstance(eps, bool)
        and 0 < eps < float("inf")
        and jnp.result_type(compute, *[d for d in (dtype, *param_dtypes) if d is not None])
        == compute
    )


def _norm(x, scale, bias, *, rms, epsilon, dtype):
    """quack_jax's norm of ``x`` with Flax's result dtype; scale and bias as Flax holds them."""
    out = canonicalize_dtype(x, scale, bias, dtype=dtype)
    x = jnp.asarray(x)
    scale, bias = (
        p if p is None or p.dtype in (jnp.float32, x.dtype) else p.astype(jnp.float32)
        for p in (scale, bias)
    )
    if rms:
        return quack_jax.rms_norm(x, scale, eps=float(epsilon), out_dtype=out)
    return quack_jax.layer_norm(x, scale, bias, eps=float(epsilon), out_dtype=out)


class RMSNorm(nn.RMSNorm):
    """``flax.linen.RMSNorm`` computed by :func:`quack_jax.rms_norm` where it can be."""

    @nn.compact
    def __call__(self, x, *, mask=None):
        if mask is not None or not _supported(x, self.dtype, [self.param_dtype], self):
            return super().__call__(x, mask=mask)
        features = [x.shape[-1]]  # a list, as Flax hands it to the initializers
        scale = None
        if self.use_scale:
            scale = self.param("scale", self.scale_init, features, self.param_dtype)
        return _norm(x, scale, None, rms=True, epsilon=self.epsilon, dtype=self.dtype)


class LayerNorm(nn.LayerNorm):
    """``flax.linen.LayerNorm`` computed by :func:`quack_jax.layer_norm` where it can be."""

    @nn.compact
    def __call__(self, x, *, mask=None):
        if mask is not None or not _supported(x, self.dtype, [self.param_dtype], self):
            return super().__call__(x, mask=mask)
        features = [x.shape[-1]]  # a list, as Flax hands it to the initializers
        scale = bias = None
        if self.use_scale:
            scale = self.param("scale", self.scale_init, features, self.param_dtype)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, features, self.param_dtype)
        return _norm(x, scale, bias, rms=False, epsilon=self.epsilon, dtype=self.dtype)


# -- the LM head and its cross-entropy, without the logits --------------------------------

# the keyword arguments that the head helpers pass on to quack_jax.linear_cross_entropy;
# the others (bias, transpose_weight, precision, preferred_element_type) are the module's
LOSS_OPTIONS = frozenset(
    (
        "ignore_index",
        "reduction",
        "label_smoothing",
        "z_loss",
        "logit_softcap",
        "return_lse",
        "chunk_size",
    )
)


def _head_loss(fn, what, x, weight, labels, kwargs, *, bias=None, transpose=False, **module):
    """``quack_jax.linear_cross_entropy`` of a Flax head's promoted ``x``, weight and bias,
    with the loss options ``kwargs`` and the module's own arguments ``module`` (precision,
    preferred_element_type), after checking that it computes what the head would: ``x``
    of shape (..., d), and a promotion that gave the three one floating dtype."""
    unknown = sorted(kwargs.keys() - LOSS_OPTIONS)
    if unknown:
        raise TypeError(
            f"{fn}: unexpected keyword argument(s) {unknown}; it takes "
            f"{sorted(LOSS_OPTIONS)} (the weight, bias and precision are {what}'s)"
        )
    d = weight.shape[1 if transpose else 0]
    if np.ndim(x) < 1 or np.shape(x)[-1] != d:
        raise ValueError(
            f"{fn}: the input must have shape (..., {d}) for {what} with {d} input features, "
            f"got {np.shape(x)}"
        )
    dtypes = {jnp.dtype(a.dtype).name for a in (x, weight, bias) if a is not None}
    if len(dtypes) != 1 or not dtypes <= set(_FLOATS):
        raise ValueError(
            f"{fn}: {what}'s promote_dtype must give the input, weight and bias one floating "
            f"dtype ({', '.join(_FLOATS)}), got {sorted(dtypes)}"
        )
    return quack_jax.linear_cross_entropy(
        x, weight, labels, bias=bias, transpose_weight=transpose, **module, **kwargs
    )


def _default_dot_general(dot_general) -> bool:
    return dot_general is None or dot_general is lax.dot_general


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
