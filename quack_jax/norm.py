"""RMSNorm and LayerNorm over the last axis, with a fused residual add.

``_forward`` computes y, h = x + residual (when there is one) and the per-row statistics
the backward needs (rstd, and mean for LayerNorm) in one pass. ``_backward`` computes dx
from dy, h and the statistics, plus the weight and bias gradients from per-CTA partials:
of a persistent grid, summed by XLA, or over few row blocks of one cluster, whose kernel
sums them itself (``_summing_cluster``); no normalised copy of x is ever stored.
``_tangent``, linear in the tangents of x, the residual, weight and bias, is the
forward-mode derivative (XLA everywhere); its transpose binds ``_backward``, so
``jax.jvp`` runs the forward kernel and ``jax.grad`` the forward and backward kernels
(at the small shapes of ``_primitive.norm_pair_on_xla``, XLA's forward in both, and
XLA's backward: docs/decisions/004-small-shape-xla-rules.md and
006-norm-pair-on-xla.md). Weight gradients come from per-CTA float32 partials, never
atomics (docs/decisions/015-weight-gradients-from-partials.md).
With the normalised axis split across devices (under a sharded ``jit``), each device
runs the XLA reference on its slice of the rows, with the rows' means ``psum``'d.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad

from ._checks import float_array, static_float
from ._configs import KernelConfig, option, scalar
from ._implementation import use_xla
from ._partition import ROWS, STAT, VECTOR, WHOLE, role_aval, varying_like
from ._primitive import (
    RowwisePrimitive,
    Target,
    compute_dtype,
    counted,
    grid_is_one_wave,
    persistent_call,
    row_tiling,
    rows,
)
from ._spec import FWD_COLUMNS, TILINGS, Benchmark, Case, OpSpec, Shapes, Tuned, fwd_bwd
from ._tiling import one_wave


@dataclasses.dataclass(frozen=True)
class NormForward(KernelConfig):
    """RMSNorm (``rms``) or LayerNorm forward. Dtype options are dtype names."""

    kernel_class = "norm:NormForward"
    kernels: ClassVar[dict] = {"rms_norm_fwd": {"rms": True}, "layer_norm_fwd": {"rms": False}}
    rms: bool = True
    residual: bool = option(False)
    weight: str | None = option()
    bias: str | None = option()
    out: str | None = option()
    staged: bool = option(True)  # row blocks prefetched through shared memory (one wave)
    eps: float = scalar(0.0)
    offset: float | None = scalar()  # with a weight only


@dataclasses.dataclass(frozen=True)
class NormBackward(KernelConfig):
    """RMSNorm or LayerNorm backward: dx, and per-CTA partials of the weight and bias
    gradients; with ``summing`` also their sums, over the one cluster that is the grid."""

    kernel_class = "norm:NormBackward"
    kernels: ClassVar[dict] = {"rms_norm_bwd": {"rms": True}, "layer_norm_bwd": {"rms": False}}
    rms: bool = True
    weight: str | None = option()
    dy: str | None = option()
    dh: bool = option(False)
    weight_grad: bool = option(False)
    bias_grad: bool = option(False)
    summing: bool = option(False)  # launched as one cluster that sums its own partials
    offset: float | None = scalar()  # with a weight only


def _split(operands, *flags):
    """The optional operands in order, None where a flag is unset, then the rest."""
    rest = list(operands)
    return [rest.pop(0) if flag else None for flag in flags] + rest


def _vmapped(reference, operands, dims, params):
    out = jax.vmap(lambda *a: list(reference(*a, **params)), in_axes=list(dims))(*operands)
    return out, [0] * len(out)


def _fold(operands, dims, vectors):
    """Operands with the batch axis first (broadcast where absent), except the vectors."""
    size = next(x.shape[d] for x, d in zip(operands, dims, strict=True) if d is not None)
    return [
        x
        if i in vectors
        else jnp.broadcast_to(x, (size, *x.shape))
        if d is None
        else jnp.moveaxis(x, d, 0)
        for i, (x, d) in enumerate(zip(operands, dims, strict=True))
    ]


# -- forward ------------------------------------------------------------------------
# operands: x, [residual], [weight], [bias]; results: y, [h], rstd, [mean]


def _forward_abstract(x, *rest, rms, residual, out_dtype, **_):
    stat = role_aval(x, STAT, compute_dtype(x.dtype))
    outs = [x.update(dtype=np.dtype(out_dtype), weak_type=False)]
    outs += [x.update(weak_type=False)] if residual else []
    return outs + [stat] * (1 if rms else 2)


def _reference_forward(
    x, *rest, rms, eps, offset, out_dtype, residual, weight, bias, differentiated, row=WHOLE
):
    res, w, b = _split(rest, residual, weight, bias)
    ct = compute_dtype(x.dtype)
    h = x if res is None else (x.astype(ct) + res.astype(ct)).astype(x.dtype)
    h32 = h.astype(ct)
    mean = jnp.zeros((*h32.shape[:-1], 1), ct) if rms else row.mean(h32)
    centred = h32 - mean
    rstd = lax.rsqrt(row.mean(centred * centred) + jnp.asarray(eps, ct))
    y = centred * rstd
    if w is not None:
        y = y * (w.astype(ct) + jnp.asarray(offset, ct))
    if b is not None:
        y = y + b.astype(ct)
    stats = [rstd[..., 0]] + ([] if rms else [mean[..., 0]])
    return [y.astype(out_dtype), *([h] if residual else []), *stats]


def forward_live(residual, weight, bias):
    """float32 values the forward keeps per element: x (and the residual), weight, bias."""
    return 1 + residual + weight + bias


def _forward_kernel(
    target: Target, avals_in, avals_out, *, rms, eps, offset, out_dtype, differentiated, **flags
):
    x = avals_in[0]
    _, w, b = _split(avals_in[1:], flags["residual"], flags["weight"], flags["bias"])
    widest = max(x.dtype.itemsize, avals_out[0].dtype.itemsize)
    family = f"{'rms' if rms else 'layer'}_norm_fwd"
    # one wave prefetches the next row blocks through shared memory; a grid of one CTA
    # per row block loads its block straight into registers
    wave = grid_is_one_wave(one_wave(family, x.shape[-1], x.dtype.itemsize))
    staged = x.dtype.itemsize * (1 + flags["residual"]) if wave else None
    tiling = row_tiling(x, family, widest, forward_live(**flags), staged)
    if tiling is None:
        return None
    config = NormForward(
        rms=rms,
        residual=flags["residual"],
        weight=w.dtype.name if w is not None else None,
        bias=b.dtype.name if b is not None else None,
        out=out_dtype if out_dtype != x.dtype.name else None,
        eps=float(eps),
        offset=float(offset) if w is not None else None,
        staged=wave,
    )
    return persistent_call(target, config, x, tiling, lambda ctas: avals_out, wave)


def _forward_batch(operands, dims, **params):
    vectors = range(1 + params["residual"], len(operands))
    if any(dims[i] is not None for i in vectors):
        return _vmapped(_reference_forward, operands, dims, params)
    outs = _forward.bind(*_fold(operands, dims, vectors), **params)
    return outs, [0] * len(outs)


def _forward_roles(*, rms, residual, weight, bias, **_):
    ins = (ROWS,) * (1 + residual) + (VECTOR,) * (weight + bias)
    return ins, (ROWS,) * (1 + residual) + (STAT,) * (1 if rms else 2)


_forward = RowwisePrimitive(
    "quack_jax_norm",
    kernel=_forward_kernel,
    reference=_reference_forward,
    abstract=_forward_abstract,
    batch=_forward_batch,
    roles=_forward_roles,
)


# -- backward -----------------------------------------------------------------------
# operands: dy, h, [weight], [dh], rstd, [mean]; results: dx, [dweight], [dbias]


def _backward_abstract(dy, h, *rest, weight_grad, bias_grad, **_):
    grad = role_aval(h, VECTOR, compute_dtype(h.dtype))
    return [h.update(weak_type=False)] + [grad] * (weight_grad + bias_grad)


def _centred(h, mean, ct):
    """h in the compute dtype ``ct`` less its row's mean (None for RMSNorm: h itself)."""
    h = h.astype(ct)
    return h if mean is None else h - mean[..., None]


def _normalised(h, rstd, mean):
    return _centred(h, mean, rstd.dtype) * rstd[..., None]


def _parameter_grads(dy, xhat, axes, weight_grad, bias_grad):
    """The weight and bias gradients (those asked for): dy * xhat and dy summed over ``axes``."""
    axes = tuple(axes)
    return [jnp.sum(dy * xhat, axis=axes)] * weight_grad + [jnp.sum(dy, axis=axes)] * bias_grad


def _reference_backward(dy, h, *rest, rms, offset, weight, dh, weight_grad, bias_grad, row=WHOLE):
    w, dh_, rstd, mean = _split(rest, weight, dh) + ([None] if rms else [])
    ct = rstd.dtype
    centred, r = _centred(h, mean, ct), rstd[..., None]
    xhat = centred * r
    dy = dy.astype(ct)
    g = dy if w is None else dy * (w.astype(ct) + jnp.asarray(offset, ct))
    # mean(g * xhat) with rstd outside the row sum, so that the sum does not wait for it:
    # on XLA's path XLA then computes it in one pass with the forward's last row sum, as
    # in its own autodiff of the plain formulation; rstd times the sum first, so that no
    # rstd**3 underflows (docs/decisions/006-norm-pair-on-xla.md)
    dx = g - xhat * (r * row.mean(g * centred))
    if not rms:
        dx = dx - row.mean(g)
    dx = dx * r
    if dh_ is not None:
        dx = dx + dh_.astype(ct)
    grads = _parameter_grads(dy, xhat, range(h.ndim - 1), weight_grad, bias_grad)
    return [dx.astype(h.dtype), *grads]


def backward_live(weight, dh, weight_grad, bias_grad):
    """float32 values the backward keeps per element: dy, h, the cotangent of h, the
    weight, and the gradient accumulators."""
    return 2 + dh + weight + weight_grad + bias_grad


def _backward_tiling(rms, dy, h, *, weight, dh, weight_grad, bias_grad):
    """The backward's tiling for cotangents like ``dy`` of rows like ``h`` (see
    ``row_tiling``)."""
    widest = max(dy.dtype.itemsize, h.dtype.itemsize)
    staged = dy.dtype.itemsize + h.dtype.itemsize * (1 + dh)
    family = f"{'rms' if rms else 'layer'}_norm_bwd"
    live = backward_live(weight, dh, weight_grad, bias_grad)
    return row_tiling(h, family, widest, live, staged)


def _backward_kernel(target: Target, avals_in, avals_out, *, rms, offset, **flags):
    dy, h = avals_in[:2]
    w, *_ = _split(avals_in[2:], flags["weight"])
    grads = flags["weight_grad"] + flags["bias_grad"]
    tiling = _backward_tiling(rms, dy, h, **flags)
    if tiling is None:
        return None
    cluster = _summing_cluster(tiling, rows(h)) if grads else 1
    config = NormBackward(
        rms=rms,
        weight=w.dtype.name if w is not None else None,
        dy=dy.dtype.name if dy.dtype != h.dtype else None,
        dh=flags["dh"],
        weight_grad=flags["weight_grad"],
        bias_grad=flags["bias_grad"],
        summing=cluster > 1,
        offset=float(offset) if w is not None else None,
    )

    def results(ctas):
        n = h.shape[-1]
        partials = [jax.ShapeDtypeStruct((ctas, n), jnp.float32)] * grads
        totals = [jax.ShapeDtypeStruct((n,), jnp.float32)] * grads * (cluster > 1)
        return [avals_out[0], *partials, *totals]

    launch = persistent_call(target, config, h, tiling, results, one_cluster=cluster)

    def fn(*operands):
        dx, *outs = launch(*operands)
        partials, totals = outs[:grads], outs[grads:]
        return [dx] + (totals if cluster > 1 else [jnp.sum(p, axis=0) for p in partials])

    return fn


# The backward of few row blocks as one cluster that sums its own weight-gradient
# partials (the summing variant): up to 2 row blocks a CTA on up to 8 CTAs measured
# faster than the backward kernel plus XLA's sum of the partials, more blocks a CTA
# slower. 8 CTAs is the portable cluster size that every sm_90 device runs, so the
# choice does not depend on the device lowered for
# (docs/decisions/016-norm-backward-summing-cluster.md).
SUM_CLUSTER_CTAS = 8
SUM_CLUSTER_BLOCKS = 2


def _summing_cluster(tiling, m: int) -> int:
    """The CTAs of the one cluster that runs a backward over ``m`` rows and sums the
    weight-gradient partials itself (the summing variant, see ``kernels/norm.py``), or 1
    where XLA sums them: from two row blocks to SUM_CLUSTER_BLOCKS a CTA of a cluster of
    up to SUM_CLUSTER_CTAS, on a tiling without a cluster of its own."""
    most = SUM_CLUSTER_CTAS * SUM_CLUSTER_BLOCKS
    blocks = counted(-(-m // tiling.rows_per_cta), few=2, many=most + 1)
    if tiling.cluster_n > 1 or not 2 <= blocks <= most:
        return 1
    return min(blocks, SUM_CLUSTER_CTAS)


def _backward_batch(operands, dims, **params):
    weight, grads = params["weight"], params["weight_grad"] or params["bias_grad"]
    vectors = (2,) if weight else ()
    if weight and dims[2] is not None:
        return _vmapped(_reference_backward, operands, dims, params)
    folded = _fold(operands, dims, vectors)
    if not grads:
        outs = _backward.bind(*folded, **params)
        return outs, [0] * len(outs)
    (dx,) = _backward.bind(*folded, **{**params, "weight_grad": False, "bias_grad": False})
    dy, h = folded[:2]
    rstd, mean = (folded[-1], None) if params["rms"] else folded[-2:]
    xhat = _normalised(h, rstd, mean)
    grads = _parameter_grads(
        dy.astype(rstd.dtype),
        xhat,
        range(1, h.ndim - 1),
        params["weight_grad"],
        params["bias_grad"],
    )
    return [dx, *grads], [0] * (1 + len(grads))


def _backward_roles(*, rms, weight, dh, weight_grad, bias_grad, **_):
    ins = (ROWS, ROWS) + (VECTOR,) * weight + (ROWS,) * dh + (STAT,) * (1 if rms else 2)
    return ins, (ROWS,) + (VECTOR,) * (weight_grad + bias_grad)


_backward = RowwisePrimitive(
    "quack_jax_norm_backward",
    kernel=_backward_kernel,
    reference=_reference_backward,
    abstract=_backward_abstract,
    batch=_backward_batch,
    roles=_backward_roles,
)


# -- tangent ------------------------------------------------------------------------
# operands: th, [tweight], [tbias], h, [weight], rstd, [mean]; results: ty, [th]
# Linear in th, tweight and tbias; its transpose is the backward. XLA everywhere.


def _tangent_abstract(th, *rest, out_dtype, prenorm, **_):
    return [th.update(dtype=np.dtype(out_dtype), weak_type=False)] + [th] * prenorm


def _reference_tangent(th, *rest, rms, offset, out_dtype, weight, bias, prenorm, row=WHOLE):
    tw, tb, h, *rest = _split(rest, weight, bias)
    w, rstd, mean = _split(rest, weight) + ([None] if rms else [])
    ct = rstd.dtype
    xhat = _normalised(h, rstd, mean)
    dh = th.astype(ct)
    if not rms:
        dh = dh - row.mean(dh)
    ty = (dh - xhat * row.mean(xhat * dh)) * rstd[..., None]
    if w is not None:
        ty = ty * (w.astype(ct) + jnp.asarray(offset, ct)) + xhat * tw.astype(ct)
    if tb is not None:
        ty = ty + tb.astype(ct)
    return [ty.astype(out_dtype)] + [th] * prenorm


def _tangent_transpose(cts, th, *rest, rms, offset, out_dtype, weight, bias, prenorm):
    if all(type(ct) is ad.Zero for ct in cts):
        return [None] * (1 + len(rest))
    dy, *dh = (ad.instantiate_zeros(ct) for ct in cts)
    tw, tb, h, *stats = _split(rest, weight, bias)
    w, *stats = _split(stats, weight)
    outs = _backward.bind(
        dy,
        h,
        *([w] * weight),
        *dh,
        *stats,
        rms=rms,
        offset=offset,
        weight=weight,
        dh=prenorm,
        weight_grad=weight,
        bias_grad=bias,
    )
    linear = [t for t in (th, tw, tb) if t is not None]
    cotangents = [
        g.astype(t.aval.dtype) if ad.is_undefined_primal(t) else None
        for t, g in zip(linear, outs, strict=True)
    ]
    return cotangents + [None] * (1 + len(rest) - len(linear))


def _tangent_batch(operands, dims, **params):
    vectors = range(1, 1 + params["weight"] + params["bias"])
    vectors = (*vectors, 2 + len(vectors)) if params["weight"] else tuple(vectors)
    if any(dims[i] is not None for i in vectors):
        return _vmapped(_reference_tangent, operands, dims, params)
    outs = _tangent.bind(*_fold(operands, dims, vectors), **params)
    return outs, [0] * len(outs)


def _tangent_roles(*, rms, weight, bias, prenorm, **_):
    ins = (ROWS,) + (VECTOR,) * (weight + bias) + (ROWS,) + (VECTOR,) * weight
    return ins + (STAT,) * (1 if rms else 2), (ROWS,) * (1 + prenorm)


_tangent = RowwisePrimitive(
    "quack_jax_norm_tangent",
    kernel=lambda target, avals_in, avals_out, **params: None,
    reference=_reference_tangent,
    abstract=_tangent_abstract,
    batch=_tangent_batch,
    transpose=_tangent_transpose,
    roles=_tangent_roles,
)


# -- differentiation ----------------------------------------------------------------
# A custom_jvp whose tangent is the linear ``_tangent`` primitive: ``jax.jvp`` runs the
# forward kernel and XLA's tangent, ``jax.grad`` the forward kernel and (the tangent's
# transpose) the backward kernel, with the cotangent of h (prenorm) added in it; at the
# shapes of ``_primitive.norm_pair_on_xla`` the forward and backward lower to XLA.


def _outputs(forward, x, residual, weight, bias, cfg, differentiated=False):
    """The public results and the backward's residuals (h, stats), by ``forward`` (the
    primitive's bind or its reference); ``differentiated``: under autodiff, where the
    statistics feed the backward (the lowering's choice of path reads it)."""
    rms, eps, offset, out_dtype, prenorm = cfg
    operands = [a for a in (x, residual, weight, bias) if a is not None]
    outs = forward(
        *operands,
        rms=rms,
        eps=eps,
        offset=offset,
        out_dtype=out_dtype,
        residual=residual is not None,
        weight=weight is not None,
        bias=bias is not None,
        differentiated=differentiated,
    )
    y, stats = outs[0], outs[1 + (residual is not None) :]
    h = x if residual is None else outs[1]
    return ((y, h) if prenorm else y), h, stats


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _norm(x, residual, weight, bias, cfg):
    return _outputs(_forward.bind, x, residual, weight, bias, cfg)[0]


@_norm.defjvp
def _norm_jvp(cfg, primals, tangents):
    rms, _, offset, out_dtype, prenorm = cfg
    x, residual, weight, bias = primals
    tx, tres, tw, tb = tangents
    out, h, stats = _outputs(_forward.bind, x, residual, weight, bias, cfg, differentiated=True)
    th = tx if residual is None else tx + tres
    operands = [a for a in (th, tw, tb, h, weight) if a is not None]
    tangent = _tangent.bind(
        *operands,
        *stats,
        rms=rms,
        offset=offset,
        out_dtype=out_dtype,
        weight=weight is not None,
        bias=bias is not None,
        prenorm=prenorm,
    )
    return out, (tuple(tangent) if prenorm else tangent[0])


# -- the public functions -----------------------------------------------------------


def _vector(fn: str, name: str, v, x):
    if v is None:
        return None
    v = float_array(fn, name, v)
    n = x.shape[-1]
    if v.shape != (n,):
        raise ValueError(f"{fn}: {name} must have shape ({n},) to match x, got {v.shape}")
    if v.dtype not in (jnp.float32, x.dtype):
        raise TypeError(
            f"{fn}: {name} must be float32 or x's dtype ({x.dtype.name}), got {v.dtype.name}"
        )
    return v


def _apply(
    fn, rms, x, weight, bias, eps, residual, prenorm, weight_offset, out_dtype, implementation
):
    x = float_array(fn, "x", x)
    weight = _vector(fn, "weight", weight, x)
    bias = _vector(fn, "bias", bias, x)
    if residual is not None:
        residual = float_array(fn, "residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"{fn}: residual must have x's shape {x.shape}, got {residual.shape}")
        if residual.dtype != x.dtype:
            raise TypeError(
                f"{fn}: residual must have x's dtype {x.dtype.name}, got {residual.dtype.name}"
            )
    eps = static_float(fn, "eps", eps, positive=True)
    offset = static_float(fn, "weight_offset", weight_offset)
    if offset and weight is None:
        raise ValueError(f"{fn}: weight_offset={offset} needs a weight")
    if not isinstance(prenorm, bool):
        raise TypeError(f"{fn}: prenorm must be a bool, got {type(prenorm).__name__}")
    if out_dtype is None:
        out = x.dtype
    else:
        try:
            out = np.dtype(out_dtype)
        except TypeError:
            raise TypeError(f"{fn}: out_dtype must be a dtype, got {out_dtype!r}") from None
        if out.name not in ("float32", "bfloat16", "float16", "float64"):
            raise TypeError(
                f"{fn}: out_dtype must be float32, bfloat16, float16 or float64, got {out.name}"
            )
        # as JAX takes a requested dtype: float64 is float32 unless x64 is enabled
        canonical = np.dtype(jax.dtypes.canonicalize_dtype(out))
        if canonical != out:
            warnings.warn(
                f"Explicitly requested dtype {out.name} requested in {fn} is not available, "
                f"and will be truncated to dtype {canonical.name}. To enable more dtypes, set "
                "the jax_enable_x64 configuration option or the JAX_ENABLE_X64 shell "
                "environment variable.",
                stacklevel=3,
            )
            out = canonical
    cfg = (rms, eps, offset, out.name, prenorm)
    weight, bias = (varying_like(x, v) for v in (weight, bias))
    if use_xla(fn, implementation):
        return _outputs(_reference_forward, x, residual, weight, bias, cfg)[0]
    return _norm(x, residual, weight, bias, cfg)


def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    residual: jax.Array | None = None,
    prenorm: bool = False,
    weight_offset: float = 0.0,
    out_dtype=None,
    implementation: str | None = None,
):
    """RMSNorm over the last axis: ``h * rsqrt(mean(h**2) + eps) * (weight + weight_offset)``.

    Args:
      x: array of any rank >= 1, float32, bfloat16 or float16 (float64 runs the XLA
        reference). Math is in float32.
      weight: optional scale of shape (n,), float32 or x's dtype.
      eps: added to the mean square; a positive Python float.
      residual: optional array of x's shape and dtype; then ``h = x + residual`` (rounded
        to x's dtype, as the unfused add would be), else ``h = x``.
      prenorm: also return h, the residual stream of a pre-norm block.
      weight_offset: added to the weight (1.0 for Gemma's ``(1 + w)`` scaling).
      out_dtype: dtype of the result (default x's); float64 is float32, with JAX's
        warning, unless x64 is enabled.
      implementation: None (the kernels on a CUDA sm_90 device, except at small shapes,
        which lower to XLA's formulation where that measured faster: the forward up to
        32 MiB of input, and RMSNorm's over rows of at most 256 elements, outside
        autodiff; under autodiff the forward with the backward, RMSNorm's from 8 rows
        over rows of at least 4096 elements up to 1 MiB, LayerNorm's from 64 rows up to
        2 MiB; the XLA fallback elsewhere) or "xla": a plain jnp formulation
        that JAX differentiates, with no quack_jax primitive in the program (to bisect a
        numerics difference).
        None follows ``$QUACK_JAX_IMPLEMENTATION`` (``xla`` or unset), read at trace
        time.

    Returns:
      y, or ``(y, h)`` with ``prenorm``. ``jax.grad`` runs one backward kernel for dx
      (and the residual's gradient, the same array) and the weight gradient, reduced
      over all rows without atomics, so it is the same on every run. ``jax.jvp`` runs
      the forward kernel and the tangent in XLA; any order of derivative works. At the
      smallest shapes (see ``implementation``) the forward and backward under autodiff
      are XLA's formulation instead of the kernels.
    """
    options = eps, residual, prenorm, weight_offset, out_dtype, implementation
    return _apply("rms_norm", True, x, weight, None, *options)


def layer_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    residual: jax.Array | None = None,
    prenorm: bool = False,
    weight_offset: float = 0.0,
    out_dtype=None,
    implementation: str | None = None,
):
    """LayerNorm over the last axis:
    ``(h - mean) * rsqrt(var + eps) * (weight + weight_offset) + bias``.

    The variance is the mean squared deviation from the mean (not ``E[h^2] - mean^2``).
    Arguments as for :func:`rms_norm`, plus ``bias`` of shape (n,), float32 or x's dtype.
    """
    options = eps, residual, prenorm, weight_offset, out_dtype, implementation
    return _apply("layer_norm", False, x, weight, bias, *options)


NORM_MIXES = ((False, False), (True, False), (True, True))  # (residual, prenorm)


def _lowerings(op: str, dtype: str, n: int, packaged: bool):
    """Forward and backward (``jax.vjp``) of ``op`` for the usual operand mixes: no weight,
    or weights in x's dtype or float32; no residual, a residual, a pre-norm one.
    ``packaged``: weights in x's dtype or float32, no residual or a pre-norm one."""
    apply = rms_norm if op == "rms_norm" else layer_norm
    param_dtypes = (dtype, "float32") if packaged else (None, dtype, "float32")
    for param_dtype in param_dtypes:
        vec = jax.ShapeDtypeStruct((n,), param_dtype) if param_dtype else None
        params = (vec,) * (1 if op == "rms_norm" else 2) if vec else ()
        for residual, prenorm in NORM_MIXES[::2] if packaged else NORM_MIXES:

            def fn(x, params, res, dy, prenorm=prenorm):
                def f(x, params, res):
                    return apply(x, *params, residual=res, prenorm=prenorm)

                out, vjp = jax.vjp(f, x, params, res)
                return out, vjp((dy, x) if prenorm else dy)

            row = jax.ShapeDtypeStruct((8, n), dtype)
            yield fn, (row, params, row if residual else None, row)


def _benchmarks():
    """Each norm with a float32 weight (and bias) of shape (N,) and y in x's dtype:
    forward, and ``jax.vjp`` w.r.t. x, weight and bias that also returns y; against a
    plain jnp formulation (float32 math, rsqrt, LayerNorm with the centred variance) and
    Flax's ``nn.RMSNorm`` / ``nn.LayerNorm`` (dtype x's, float32 params, the same epsilon;
    its columns stay empty without Flax). The arguments are x, weight, [bias], dy."""
    return [_benchmark("rms_norm", True), _benchmark("layer_norm", False)]


def _benchmark(name: str, rms: bool):
    try:
        import flax.linen as nn
    except ImportError:
        nn = None
    eps = 1e-6
    shapes = [(32768, 1024), (16384, 4096), (8192, 8192), (4096, 16384), (2048, 65536)]
    quick = [(1024, 1024), (128, 8192)]  # fwd+bwd in bfloat16 is slow on a CPU

    def statistics(x):
        """x in float32 (centred for LayerNorm), its per-row rstd and mean."""
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1)
        centred = x32 if rms else x32 - mean[..., None]
        return centred, lax.rsqrt(jnp.mean(centred * centred, axis=-1) + eps), mean

    def quack_fn(x, *params):
        return (rms_norm if rms else layer_norm)(x, *params, eps=eps)

    def xla_fn(x, weight, bias=None):
        centred, rstd, _ = statistics(x)
        y = centred * rstd[..., None] * weight
        return (y if bias is None else y + bias).astype(x.dtype)

    def flax_fn(x, weight, bias=None):
        params = {"scale": weight} | ({} if bias is None else {"bias": bias})
        module = (nn.RMSNorm if rms else nn.LayerNorm)(
            epsilon=eps, dtype=x.dtype, param_dtype=jnp.float32
        )
        return module.apply({"params": params}, x)

    flags = dict(weight=True, dh=False, weight_grad=True, bias_grad=not rms)

    def backward(*operands):
        return _backward.bind(*operands, rms=rms, offset=0.0, **flags)

    def backward_operands(x, weight, *rest):
        _, rstd, mean = statistics(x)
        return (rest[-1], x, weight, rstd) + (() if rms else (mean,))

    refs = [("xla", "XLA", xla_fn)] + [("flax", "Flax", flax_fn)] * (nn is not None)
    return Benchmark(
        name,
        shapes,
        quick,
        arguments=lambda m, n, dtype: (
            [((m, n), dtype)] + [((n,), "float32")] * (1 if rms else 2) + [((m, n), dtype)]
        ),
        cases=[
            Case("quack_fwd", "quack_jax fwd", 2, quack_fn, -1, kernel=True),
            Case("xla_fwd", "XLA fwd", 2, xla_fn, -1),
            Case("quack_fwd_bwd", "quack_jax fwd+bwd", 5, fwd_bwd(quack_fn), kernel=True),
        ]
        + [Case(f"{k}_fwd_bwd", f"{label} fwd+bwd", 5, fwd_bwd(f)) for k, label, f in refs],
        tuned=[
            Tuned(
                "fwd",
                f"{name}_fwd",
                2,
                quack_fn,
                lambda *args: args[:-1],
                lambda: forward_live(residual=False, weight=True, bias=not rms),
                1,
                True,
            ),
            Tuned(
                "bwd",
                f"{name}_bwd",
                3,
                backward,
                backward_operands,
                lambda: backward_live(**flags),
                2,
            ),
        ],
        columns=[
            *FWD_COLUMNS,
            ("quack fwd+bwd TB/s", "rate", "quack_fwd_bwd"),
            ("XLA fwd+bwd TB/s", "rate", "xla_fwd_bwd"),
            ("Flax fwd+bwd TB/s", "rate", "flax_fwd_bwd"),
            ("speedup vs XLA", "speedup", "xla_fwd_bwd", "quack_fwd_bwd"),
            ("speedup vs Flax", "speedup", "flax_fwd_bwd", "quack_fwd_bwd"),
            TILINGS,
        ],
        footprint=8,
        latency_shapes=Benchmark.latency((1024, 2048, 4096, 8192))
        + list(Benchmark.QK_NORM_SHAPES if rms else ()),
    )


SPEC = OpSpec(
    ops=("rms_norm", "layer_norm"),
    configs=(NormForward, NormBackward),
    sizes="hidden",
    lowerings=_lowerings,
    tests={
        "cpu": Shapes(rows=(1, 3), sizes=(1, 7, 128, 1000, 5000), special=(40,)),
        "gpu": Shapes(
            rows=(1, 3, 1000, 16384),
            sizes=(1, 7, 128, 1000, 4096, 5120, 8192, 16384, 65536),
            special=(7, 1024, 65536),
        ),
    },
    benchmarks=_benchmarks,
)
