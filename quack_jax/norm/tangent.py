"""The norm tangent primitive: the forward-mode derivative, linear in the tangents of x,
the residual, weight and bias; its transpose binds the backward. XLA everywhere."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from .._partition import ROWS, STAT, VECTOR, WHOLE
from .._primitive import RowwisePrimitive
from .backward import backward
from .operands import fold, normalised, split, vmapped

# operands: th, [tweight], [tbias], h, [weight], rstd, [mean]; results: ty, [th]
# Linear in th, tweight and tbias; its transpose is the backward. XLA everywhere.


def _tangent_abstract(th, *rest, out_dtype, prenorm, **_):
    return [th.update(dtype=np.dtype(out_dtype), weak_type=False)] + [th] * prenorm


def _reference_tangent(th, *rest, rms, weight_offset, out_dtype, weight, bias, prenorm, row=WHOLE):
    tw, tb, h, *rest = split(rest, weight, bias)
    w, rstd, mean = split(rest, weight) + ([None] if rms else [])
    ct = rstd.dtype
    xhat = normalised(h, rstd, mean)
    dh = th.astype(ct)
    if not rms:
        dh = dh - row.mean(dh)
    ty = (dh - xhat * row.mean(xhat * dh)) * rstd[..., None]
    if w is not None:
        ty = ty * (w.astype(ct) + jnp.asarray(weight_offset, ct)) + xhat * tw.astype(ct)
    if tb is not None:
        ty = ty + tb.astype(ct)
    return [ty.astype(out_dtype)] + [th] * prenorm


def _tangent_transpose(cts, th, *rest, rms, weight_offset, out_dtype, weight, bias, prenorm):
    if all(type(ct) is ad.Zero for ct in cts):
        return [None] * (1 + len(rest))
    dy, *dh = (ad.instantiate_zeros(ct) for ct in cts)
    tw, tb, h, *stats = split(rest, weight, bias)
    w, *stats = split(stats, weight)
    outs = backward.bind(
        dy,
        h,
        *([w] * weight),
        *dh,
        *stats,
        rms=rms,
        weight_offset=weight_offset,
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
        return vmapped(_reference_tangent, operands, dims, params)
    outs = tangent.bind(*fold(operands, dims, vectors), **params)
    return outs, [0] * len(outs)


def _tangent_roles(*, rms, weight, bias, prenorm, **_):
    ins = (ROWS,) + (VECTOR,) * (weight + bias) + (ROWS,) + (VECTOR,) * weight
    return ins + (STAT,) * (1 if rms else 2), (ROWS,) * (1 + prenorm)


tangent = RowwisePrimitive(
    "quack_jax_norm_tangent",
    kernel=lambda target, avals_in, avals_out, **params: None,
    reference=_reference_tangent,
    abstract=_tangent_abstract,
    batch=_tangent_batch,
    transpose=_tangent_transpose,
    roles=_tangent_roles,
)
