"""Trace-time validation of public arguments: clear errors that name the argument."""

from __future__ import annotations

import math
import numbers
import operator

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def float_array(fn: str, name: str, x):
    """``x`` as a JAX array of a floating dtype with at least one dimension."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")) or isinstance(x, type):
        raise TypeError(
            f"{fn}: {name} must be an array (jax.Array or numpy.ndarray), got {type(x).__name__}"
        )
    dtype = np.dtype(x.dtype)
    if dtype.name not in FLOAT_DTYPES:
        raise TypeError(
            f"{fn}: {name} must have a floating dtype ({', '.join(FLOAT_DTYPES)}), got {dtype.name}"
        )
    if len(x.shape) < 1:
        raise ValueError(f"{fn}: {name} must have at least one dimension, got a scalar")
    return jnp.asarray(x)


def axis_index(fn: str, axis, ndim: int, allowed: str = "an int") -> int:
    """``axis`` normalised to [0, ndim); ``allowed`` says what ``fn`` takes as an axis."""
    try:
        index = operator.index(axis)
    except TypeError:
        raise TypeError(f"{fn}: axis must be {allowed}, got {type(axis).__name__}") from None
    if not -ndim <= index < ndim:
        raise ValueError(f"{fn}: axis {axis} is out of range for an array of rank {ndim}")
    return index % ndim


def static_float(fn: str, name: str, value, *, low=None, high=None, positive=False) -> float:
    """``value`` as a finite Python float (a static value, not an array): above 0 with
    ``positive``, at least ``low`` and below ``high`` where they are given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{fn}: {name} must be a Python float (a static value, not an array), "
            f"got {type(value).__name__}"
        )
    value = float(value)
    ok = math.isfinite(value) and (value > 0 or not positive)
    ok = ok and (low is None or value >= low) and (high is None or value < high)
    if not ok:
        if positive:
            allowed = "positive and finite"
        elif high is not None:
            allowed = f"in [{low}, {high})"
        else:
            allowed = "finite" if low is None else f">= {low} and finite"
        raise ValueError(f"{fn}: {name} must be {allowed}, got {value}")
    return value
