"""Softmax and log-softmax with fused forward and derivative kernels.

The forward primitive computes y from x. The derivative primitive is linear in its first
operand t and reads one saved operand s. Softmax's reads its output (s = y):
``y * (t - sum(t * y))``, which is its own transpose. Log-softmax's recompute p =
softmax(x) from x (s = x), since a 16-bit log-probability gives p only to
``|log p| * 2^-8`` relative: the forward-mode form ``t - sum(p * t)`` and its transpose
``t - p * sum(t)`` (docs/decisions/012-softmax-derivative-from-saved-y.md). ``jax.grad``
therefore runs the forward kernel and one derivative kernel that reads s and the
cotangent and writes the gradient (log-softmax's forward kernel only where its output is
used); ``jax.jvp`` likewise. At small shapes the default lowering takes XLA's formulation
of the forward, and of softmax's derivative over short rows, where that measured faster
(docs/decisions/004-small-shape-xla-rules.md and 005-softmax-derivative-on-xla.md). With
the softmax axis split across devices (under a sharded ``jit``), each device runs the XLA
reference on its slice of the rows, with the rows' max and sums combined by
``pmax``/``psum``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from ._checks import axis_index, float_array
from ._configs import KernelConfig
from ._implementation import use_xla
from ._partition import WHOLE
from ._primitive import RowwisePrimitive, compute_dtype, kernel_call, row_tiling
from ._spec import (
    FWD_BWD_COLUMNS,
    FWD_COLUMNS,
    TILINGS,
    Benchmark,
    Case,
    OpSpec,
    Shapes,
    Tuned,
    fwd_bwd,
)

_TRANSPOSED = {"softmax": "softmax", "log_vjp": "log_jvp", "log_jvp": "log_vjp"}


@dataclasses.dataclass(frozen=True)
class Softmax(KernelConfig):
    """The forward kernels: y from x."""

    kernel_class = "softmax:SoftmaxForward"
    kernels: ClassVar[dict] = {"softmax_fwd": {"log": False}, "log_softmax_fwd": {"log": True}}
    log: bool = False


@dataclasses.dataclass(frozen=True)
class SoftmaxDerivative(KernelConfig):
    """The derivative kernels, linear in t: ``kind`` is "softmax" (reads y), "log_vjp" or
    "log_jvp" (read x)."""

    kernel_class = "softmax:SoftmaxDerivative"
    kernels: ClassVar[dict] = {
        "softmax_bwd": {"kind": "softmax"},
        "log_softmax_bwd": {"kind": "log_vjp"},
        "log_softmax_jvp": {"kind": "log_jvp"},
    }
    kind: str = "softmax"


def _reference_forward(x, *, log: bool, row=WHOLE):
    x32 = x.astype(compute_dtype(x.dtype))
    shifted = x32 - jax.lax.stop_gradient(row.max(x32))
    e = jnp.exp(shifted)
    total = row.sum(e)
    y = shifted - jnp.log(total) if log else e / total
    return (y.astype(x.dtype),)


def _reference_derivative(t, s, *, kind: str, row=WHOLE):
    """The derivative along t from the saved operand s: y for softmax, x for log-softmax."""
    t32 = t.astype(compute_dtype(t.dtype))
    if kind == "softmax":
        y = s.astype(t32.dtype)
        return ((y * (t32 - row.sum(t32 * y))).astype(t.dtype),)
    (p,) = _reference_forward(s.astype(t32.dtype), log=False, row=row)
    out = t32 - p * row.sum(t32) if kind == "log_vjp" else t32 - row.sum(p * t32)
    return (out.astype(t.dtype),)


def _forward_jvp(primals, tangents, *, log):
    (x,), (x_dot,) = primals, tangents
    y = _forward.bind(x, log=log)
    kind, saved = ("log_jvp", x) if log else ("softmax", y[0])
    return y, _derivative.bind(ad.instantiate_zeros(x_dot), saved, kind=kind)


def _derivative_transpose(cts, t, s, *, kind):
    (ct,) = cts
    assert ad.is_undefined_primal(t) and not ad.is_undefined_primal(s)
    if type(ct) is ad.Zero:
        return [None, None]
    return [_derivative.bind(ct, s, kind=_TRANSPOSED[kind])[0], None]


def _kernel(family: str, config: type[KernelConfig]):
    """The kernel lowering: the primitive's params are the config's fields."""

    def kernel(target, avals_in, avals_out, **params):
        tiling = row_tiling(avals_in[0], family)
        return tiling and kernel_call(target, config(**params), avals_in[0], tiling, avals_out)

    return kernel


# Where XLA's formulation measured faster (small and decode shapes): the forward up to
# SOFTMAX_BYTES of input (docs/decisions/004-small-shape-xla-rules.md), and softmax's
# derivative over rows of at most SOFTMAX_DERIVATIVE_N elements, where its forward is on
# XLA too (docs/decisions/005-softmax-derivative-on-xla.md).
SOFTMAX_BYTES, SOFTMAX_DERIVATIVE_N = 8 << 20, 2048


def _forward_on_xla(m: int, n: int, itemsize: int, **_) -> bool:
    return m * n * itemsize <= SOFTMAX_BYTES


def _derivative_on_xla(m: int, n: int, itemsize: int, *, kind, **_) -> bool:
    return kind == "softmax" and n <= SOFTMAX_DERIVATIVE_N and m * n * itemsize <= SOFTMAX_BYTES


_forward = RowwisePrimitive(
    "quack_jax_softmax",
    kernel=_kernel("softmax_fwd", Softmax),
    prefers_reference=_forward_on_xla,
    reference=_reference_forward,
    jvp=_forward_jvp,
)
_derivative = RowwisePrimitive(
    "quack_jax_softmax_derivative",
    kernel=_kernel("softmax_bwd", SoftmaxDerivative),
    prefers_reference=_derivative_on_xla,
    reference=_reference_derivative,
    transpose=_derivative_transpose,
)


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
    forward = _reference_forward if xla else _forward.bind
    if where is not None:
        where = _mask(fn, where, x.shape)
        x = jnp.where(where, x, -jnp.inf)
    moved = jnp.moveaxis(x, axes, last)
    rows = moved.reshape(*moved.shape[: last[0]], math.prod(moved.shape[last[0] :]))
    y = jnp.moveaxis(forward(rows, log=log)[0].reshape(moved.shape), last, axes)
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


def _lowerings(op: str, dtype: str, n: int, packaged: bool):
    """The forward and ``jax.vjp`` (forward and backward kernels); for log-softmax also
    ``jax.jvp`` (its forward-mode kernel)."""
    f = softmax if op == "softmax" else log_softmax
    x = jax.ShapeDtypeStruct((8, n), dtype)

    def vjp(x):
        y, pullback = jax.vjp(f, x)
        return y, pullback(x)

    yield vjp, (x,)
    if op == "log_softmax":
        yield (lambda x: jax.jvp(f, (x,), (x,))), (x,)


def _benchmarks():
    """softmax against ``jax.nn.softmax``: forward, and ``jax.vjp`` that also returns y."""
    shapes = [(32768, 1024), (16384, 4096), (8192, 16384), (4096, 65536), (2048, 131072)]
    shapes += [(1024, 262144)]

    def derivative(dy, y):
        return _derivative.bind(dy, y, kind="softmax")[0]

    return [
        Benchmark(
            "softmax",
            shapes,
            quick_shapes=[(4096, 1024), (512, 8192)],
            arguments=lambda m, n, dtype: [((m, n), dtype)] * 2,
            cases=[
                Case("quack_fwd", "quack_jax fwd", 2, softmax, -1, kernel=True),
                Case("xla_fwd", "XLA fwd", 2, jax.nn.softmax, -1),
                Case("quack_fwd_bwd", "quack_jax fwd+bwd", 5, fwd_bwd(softmax), kernel=True),
                Case("xla_fwd_bwd", "XLA fwd+bwd", 5, fwd_bwd(jax.nn.softmax)),
            ],
            tuned=[
                Tuned("fwd", "softmax_fwd", 2, softmax, lambda x, dy: (x,)),
                Tuned("bwd", "softmax_bwd", 3, derivative, lambda x, dy: (dy, softmax(x))),
            ],
            columns=[
                *FWD_COLUMNS,
                ("fwd / copy", "fraction", "quack_fwd", "copy"),
                *FWD_BWD_COLUMNS,
                TILINGS,
            ],
            footprint=6,
            latency_shapes=Benchmark.latency((1024, 4096, 8192)),  # attention rows
        )
    ]


SPEC = OpSpec(
    ops=("softmax", "log_softmax"),
    configs=(Softmax, SoftmaxDerivative),
    sizes="sequence",
    lowerings=_lowerings,
    tests={
        "cpu": Shapes(rows=(1, 3), sizes=(1, 7, 1000, 5000, 131071), special=(40,)),
        "gpu": Shapes(
            rows=(1, 3, 1000, 32768),
            sizes=(1, 7, 100, 1024, 4096, 5000, 16384, 65536, 131071, 262144),
            special=(7, 1024, 65536),  # one row per warp, several warps, a cluster
        ),
    },
    benchmarks=_benchmarks,
)
