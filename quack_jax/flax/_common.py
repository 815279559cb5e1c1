"""What the linen and nnx modules share, in a module that imports neither ``flax.linen``
nor ``flax.nnx``, so each of them imports without the other."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np
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


def _norm(x, scale, bias, out, *, rms, epsilon, residual=None):
    """quack_jax's norm of ``x`` with Flax's result dtype ``out`` (its ``canonicalize_dtype``
    of x, scale, bias and the module's dtype); scale and bias as Flax holds them. With a
    ``residual`` of x's shape and dtype: ``(norm(x + residual), x + residual)``."""
    x = jnp.asarray(x)
    scale, bias = (
        p if p is None or p.dtype in (jnp.float32, x.dtype) else p.astype(jnp.float32)
        for p in (scale, bias)
    )
    stream = {"residual": residual, "prenorm": residual is not None}
    if rms:
        return quack_jax.rms_norm(x, scale, eps=float(epsilon), out_dtype=out, **stream)
    return quack_jax.layer_norm(x, scale, bias, eps=float(epsilon), out_dtype=out, **stream)


def _flax_norm(call, x, residual):
    """Flax's own norm ``call`` of ``x``, or with a ``residual``
    ``(call(x + residual), x + residual)`` (of the two as arrays, as Flax takes x)."""
    if residual is None:
        return call(x)
    h = jnp.asarray(x) + jnp.asarray(residual)
    return call(h), h


def _computes(norm, x, promoted, param_dtypes, mask, residual) -> bool:
    """Whether quack_jax computes ``norm`` (a Flax norm module) of ``x``, which the module
    promotes to ``promoted``: without a mask, where ``_supported``, and with a residual
    that it adds as ``x + residual`` would (``_stream_supported``)."""
    return (
        mask is None
        and _supported(promoted, norm.dtype, param_dtypes, norm)
        and _stream_supported(x, promoted, residual)
    )


def _stream_supported(x, promoted, residual) -> bool:
    """Whether quack_jax adds ``residual`` to ``x`` as ``x + residual`` would before a
    norm that computes on ``promoted`` (x as the module promotes it): both of x's shape
    and dtype, which the promotion keeps."""
    if residual is None:
        return True
    same = getattr(residual, "dtype", None) == getattr(x, "dtype", None) == promoted.dtype
    return same and jnp.shape(residual) == jnp.shape(x)


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
