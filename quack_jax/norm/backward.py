"""The norm backward primitive: dx from dy, h and the forward's statistics, and the
weight and bias gradients from per-CTA float32 partials."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._partition import ROWS, STAT, VECTOR, WHOLE, role_aval
from .._primitive import (
    RowwisePrimitive,
    Target,
    compute_dtype,
    counted,
    persistent_call,
    row_tiling,
    rows,
)
from .config import NormBackward
from .operands import centred, fold, normalised, parameter_grads, split, vmapped
from .rules import backward_on_xla
from .tilings import backward_family

# operands: dy, h, [weight], [dh], rstd, [mean]; results: dx, [dweight], [dbias]


def _backward_abstract(dy, h, *rest, weight_grad, bias_grad, **_):
    grad = role_aval(h, VECTOR, compute_dtype(h.dtype))
    return [h.update(weak_type=False)] + [grad] * (weight_grad + bias_grad)


def reference_backward(
    dy, h, *rest, rms, weight_offset, weight, dh, weight_grad, bias_grad, row=WHOLE
):
    w, dh_, rstd, mean = split(rest, weight, dh) + ([None] if rms else [])
    ct = rstd.dtype
    hc, r = centred(h, mean, ct), rstd[..., None]
    xhat = hc * r
    dy = dy.astype(ct)
    g = dy if w is None else dy * (w.astype(ct) + jnp.asarray(weight_offset, ct))
    # mean(g * xhat) with rstd outside the row sum, so that the sum does not wait for it:
    # on XLA's path XLA then computes it in one pass with the forward's last row sum, as
    # in its own autodiff of the plain formulation; rstd times the sum first, so that no
    # rstd**3 underflows (docs/decisions/006-norm-pair-on-xla.md)
    dx = g - xhat * (r * row.mean(g * hc))
    if not rms:
        dx = dx - row.mean(g)
    dx = dx * r
    if dh_ is not None:
        dx = dx + dh_.astype(ct)
    grads = parameter_grads(dy, xhat, range(h.ndim - 1), weight_grad, bias_grad)
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
    live = backward_live(weight, dh, weight_grad, bias_grad)
    return row_tiling(h, backward_family(rms), widest, live, staged)


def _backward_kernel(target: Target, avals_in, avals_out, *, rms, weight_offset, **flags):
    dy, h = avals_in[:2]
    w, *_ = split(avals_in[2:], flags["weight"])
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
        weight_offset=float(weight_offset) if w is not None else None,
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
        return vmapped(reference_backward, operands, dims, params)
    folded = fold(operands, dims, vectors)
    if not grads:
        outs = backward.bind(*folded, **params)
        return outs, [0] * len(outs)
    (dx,) = backward.bind(*folded, **{**params, "weight_grad": False, "bias_grad": False})
    dy, h = folded[:2]
    rstd, mean = (folded[-1], None) if params["rms"] else folded[-2:]
    xhat = normalised(h, rstd, mean)
    grads = parameter_grads(
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


backward = RowwisePrimitive(
    "quack_jax_norm_backward",
    kernel=_backward_kernel,
    prefers_reference=backward_on_xla,
    reference=reference_backward,
    abstract=_backward_abstract,
    batch=_backward_batch,
    roles=_backward_roles,
)
