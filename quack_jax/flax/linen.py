"""``RMSNorm`` and ``LayerNorm`` for ``flax.linen``, running quack_jax where they can."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.linen.dtypes import canonicalize_dtype

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
