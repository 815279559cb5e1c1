"""``softmax`` and ``log_softmax``: the axes and the mask, checked once, around the
forward primitive, whose JVP rule (``forward.py``) is their differentiation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .._checks import axis_index, float_array
from .._implementation import use_xla
from .forward import forward
from .reference import reference_forward


def _axes(fn: str, axis, ndim: int) -> tuple:
    """``axis`` (an int, a tuple of ints, or None for all) as sorted axes in [0, ndim)."""
    if axis is None:
        return tuple(range(ndim))
    allowed = "an int, a tuple of ints or None"
    if not isinstance(axis, tuple | list):
        return (axis_index(fn, axis, ndim, allowed),)
    axes = sorted(axis_index(fn, a, ndim, allowed) for a in axis)
    if not axes or len(set(axes)) < len(axes):
        raise ValueError(
            f"{fn}: axis must name each axis once, and at least one, got {tuple(axis)}"
        )
    return tuple(axes)


def _mask(fn: str, where, shape):
    """``where`` as a boolean array that broadcasts to ``shape``."""
    if not (hasattr(where, "shape") and hasattr(where, "dtype")):
        raise TypeError(f"{fn}: where must be a boolean array, got {type(where).__name__}")
    if where.dtype != bool:
        raise TypeError(f"{fn}: where must be a boolean array, got dtype {where.dtype}")
    try:
        fits = jnp.broadcast_shapes(where.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{fn}: where must broadcast to x's shape {shape}, got {where.shape}")
    return jnp.asarray(where)


def _apply(fn: str, x, axis, where, log: bool, implementation):
    x = float_array(fn, "x", x)
    axes = _axes(fn, axis, x.ndim)
    last = tuple(range(x.ndim - len(axes), x.ndim))
    xla = use_xla(fn, implementation) or (len(axes) > 1 and axes != last)
    forward_fn = reference_forward if xla else forward.bind
    if where is not None:
        where = _mask(fn, where, x.shape)
        x = jnp.where(where, x, -jnp.inf)
    moved = jnp.moveaxis(x, axes, last)
    rows = moved.reshape(*moved.shape[: last[0]], math.prod(moved.shape[last[0] :]))
    y = jnp.moveaxis(forward_fn(rows, log=log)[0].reshape(moved.shape), last, axes)
    return y if where is None else jnp.where(where, y, -jnp.inf if log else 0)


def softmax(
    x: jax.Array, axis=-1, where: jax.Array | None = None, *, implementation: str | None = None
) -> jax.Array:
    """Softmax over ``axis``: ``exp(x - max) / sum(exp(x - max))``, as ``jax.nn.softmax``.

    Args:
      x: array of any rank >= 1, float32, bfloat16 or float16 (float64 runs the XLA
        reference). Math is in float32; the result has ``x``'s dtype and shape.
      axis: the axis, a tuple of axes, or None (all axes) to normalise over. The last
        axis is fastest; trailing axes (or None) are flattened into one row for free; a
        single other axis is moved last and back, which costs a transpose on each side;
        a tuple of axes that are not trailing runs the XLA formulation.
      where: optional boolean mask that broadcasts to x: only its True elements take
        part; the others give 0 (-inf for log_softmax), as do rows with none, and get
        zero derivatives. The kernel runs on ``jnp.where(where, x, -inf)``, an XLA select
        on each side of it.
      implementation: None (the kernels on a CUDA sm_90 device, except the forward up
        to 8 MiB of input, and softmax's derivative there over rows of at most 2048,
        which lower to XLA's formulation where that measured faster; the XLA fallback
        elsewhere) or "xla": a plain jnp formulation that JAX
        differentiates, with no quack_jax primitive in the program (to bisect a
        numerics difference). None follows ``$QUACK_JAX_IMPLEMENTATION`` (``xla`` or
        unset), read at trace time.

    NaN and infinities propagate as in ``jax.nn.softmax`` (a row holding NaN or +inf,
    or only -inf, gives NaN). Differentiable to any order; ``jax.grad`` runs one fused
    backward kernel ``dx = y * (dy - sum(dy * y))`` that reads the saved y (XLA's
    formulation of it at the small shapes above).
    """
    return _apply("softmax", x, axis, where, False, implementation)


def log_softmax(
    x: jax.Array, axis=-1, where: jax.Array | None = None, *, implementation: str | None = None
) -> jax.Array:
    """Log-softmax over ``axis``: ``x - max - log(sum(exp(x - max)))``, as
    ``jax.nn.log_softmax``.

    Same arguments, dtypes and special values as :func:`softmax` (masked elements give
    -inf); ``jax.grad`` runs one fused backward kernel ``dx = dy - softmax(x) * sum(dy)``,
    which recomputes softmax(x) from x.
    """
    return _apply("log_softmax", x, axis, where, True, implementation)
