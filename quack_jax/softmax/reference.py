"""XLA's formulations of the forward and the derivative: the primitives' references (the
fallback, and each device's function where the softmax axis is split) and the
``implementation="xla"`` path."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._partition import WHOLE
from .._primitive import compute_dtype


def reference_forward(x, *, log: bool, row=WHOLE):
    x32 = x.astype(compute_dtype(x.dtype))
    shifted = x32 - jax.lax.stop_gradient(row.max(x32))
    e = jnp.exp(shifted)
    total = row.sum(e)
    y = shifted - jnp.log(total) if log else e / total
    return (y.astype(x.dtype),)


def reference_derivative(t, s, *, kind: str, row=WHOLE):
    """The derivative along t from the saved operand s: y for softmax, x for log-softmax."""
    t32 = t.astype(compute_dtype(t.dtype))
    if kind == "softmax":
        y = s.astype(t32.dtype)
        return ((y * (t32 - row.sum(t32 * y))).astype(t.dtype),)
    (p,) = reference_forward(s.astype(t32.dtype), log=False, row=row)
    out = t32 - p * row.sum(t32) if kind == "log_vjp" else t32 - row.sum(p * t32)
    return (out.astype(t.dtype),)
