"""The norm forward primitive: y, h = x + residual (with a residual) and the per-row
statistics (rstd, and mean for LayerNorm) in one pass."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._partition import ROWS, STAT, VECTOR, WHOLE, role_aval
from .._primitive import (
    RowwisePrimitive,
    Target,
    compute_dtype,
    grid_is_one_wave,
    persistent_call,
    row_tiling,
)
from .config import NormForward
from .operands import fold, split, vmapped
from .rules import forward_on_xla
from .tilings import forward_family

# operands: x, [residual], [weight], [bias]; results: y, [h], rstd, [mean]


def _forward_abstract(x, *rest, rms, residual, out_dtype, **_):
    stat = role_aval(x, STAT, compute_dtype(x.dtype))
    outs = [x.update(dtype=np.dtype(out_dtype), weak_type=False)]
    outs += [x.update(weak_type=False)] if residual else []
    return outs + [stat] * (1 if rms else 2)


def reference_forward(
    x, *rest, rms, eps, weight_offset, out_dtype, residual, weight, bias, differentiated, row=WHOLE
):
    res, w, b = split(rest, residual, weight, bias)
    ct = compute_dtype(x.dtype)
    h = x if res is None else (x.astype(ct) + res.astype(ct)).astype(x.dtype)
    h32 = h.astype(ct)
    mean = jnp.zeros((*h32.shape[:-1], 1), ct) if rms else row.mean(h32)
    centred = h32 - mean
    rstd = lax.rsqrt(row.mean(centred * centred) + jnp.asarray(eps, ct))
    y = centred * rstd
    if w is not None:
        y = y * (w.astype(ct) + jnp.asarray(weight_offset, ct))
    if b is not None:
        y = y + b.astype(ct)
    stats = [rstd[..., 0]] + ([] if rms else [mean[..., 0]])
    return [y.astype(out_dtype), *([h] if residual else []), *stats]


def forward_live(residual, weight, bias):
    """float32 values the forward keeps per element: x (and the residual), weight, bias."""
    return 1 + residual + weight + bias


def _forward_kernel(
    target: Target,
    avals_in,
    avals_out,
    *,
    rms,
    eps,
    weight_offset,
    out_dtype,
    differentiated,
    **flags,
):
    x = avals_in[0]
    _, w, b = split(avals_in[1:], flags["residual"], flags["weight"], flags["bias"])
    widest = max(x.dtype.itemsize, avals_out[0].dtype.itemsize)
    family = forward_family(rms)
    # one wave prefetches the next row blocks through shared memory; a grid of one CTA
    # per row block loads its block straight into registers
    wave = grid_is_one_wave(family.one_wave(x.shape[-1], x.dtype.itemsize))
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
        weight_offset=float(weight_offset) if w is not None else None,
        staged=wave,
    )
    return persistent_call(target, config, x, tiling, lambda ctas: avals_out, wave)


def _forward_batch(operands, dims, **params):
    vectors = range(1 + params["residual"], len(operands))
    if any(dims[i] is not None for i in vectors):
        return vmapped(reference_forward, operands, dims, params)
    outs = forward.bind(*fold(operands, dims, vectors), **params)
    return outs, [0] * len(outs)


def _forward_roles(*, rms, residual, weight, bias, **_):
    ins = (ROWS,) * (1 + residual) + (VECTOR,) * (weight + bias)
    return ins, (ROWS,) * (1 + residual) + (STAT,) * (1 if rms else 2)


forward = RowwisePrimitive(
    "quack_jax_norm",
    kernel=_forward_kernel,
    prefers_reference=forward_on_xla,
    reference=reference_forward,
    abstract=_forward_abstract,
    batch=_forward_batch,
    roles=_forward_roles,
)
