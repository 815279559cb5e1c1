"""Cross-entropy with integer labels over the last axis (the vocabulary).

``_forward`` reads the logits once and gives the per-row loss and the row statistics
(shift, logsum), whose sum is the logsumexp, and when asked the gradient of a weighted
sum of the rows' losses, from the rows it holds
(docs/decisions/011-cross-entropy-forward-writes-gradient.md). ``_backward`` reads the
logits once more and writes their gradient, from the statistics and three per-row
coefficients that fold in the cotangents and the options. The statistics stay apart,
never summed to lse before ``exp(x - shift - logsum)``, so that large logits keep their
precision (docs/decisions/010-cross-entropy-row-statistics.md). No (rows, vocab) float32
intermediate exists on either path. ``jax.grad`` and ``jax.jvp`` reach them through
``custom_jvp``s (see "differentiation" below): a "sum" or "mean" loss takes the one-pass
gradient, per-row losses (or lse) the two-kernel one. The reductions over rows are plain
XLA on per-row values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from ._checks import axis_index, float_array, static_float
from ._configs import KernelConfig, option, scalar
from ._implementation import use_xla
from ._partition import ROWS, STAT, WHOLE, role_aval
from ._primitive import RowwisePrimitive, Target, compute_dtype, kernel_call, row_tiling
from ._spec import (
    FWD_BWD_COLUMNS,
    FWD_COLUMNS,
    TILINGS,
    Benchmark,
    Case,
    OpSpec,
    Shapes,
    Tuned,
)

REDUCTIONS = ("none", "sum", "mean")
_INT32 = np.iinfo(np.int32)


def _capped(logits, softcap):
    x = logits.astype(compute_dtype(logits.dtype))
    return x if softcap is None else softcap * jnp.tanh(x / softcap)


def _tempered(logits, softcap, temperature):
    """z: the (softcapped) logits over the temperature, and the softcapped logits."""
    x = _capped(logits, softcap)
    return (x if temperature == 1.0 else x / temperature), x


def _masked_sum(p, values, row=WHOLE):
    """sum(p * values) over the row, where terms with p = 0 count 0 (-inf logits; the
    select comes first, so that autodiff sees no 0 * inf either)."""
    return row.sum(p * jnp.where(p > 0, values, 0.0))[..., 0]


def _row_stat(x):
    return role_aval(x, STAT, compute_dtype(x.dtype))


def _row_stats(x):
    """The row statistics of x (float32 or float64) as the kernels make them: shift, the
    max (0 where it is infinite or NaN), and ``logsum = log(sum(exp(x - shift)))``; their
    sum is logsumexp."""
    top = jnp.max(x, axis=-1)
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    return shift, jnp.log(jnp.sum(jnp.exp(x - shift[..., None]), axis=-1))


def _coefficients(labels, n, ignore_index, smoothing, z_loss, lse, g, g_lse=0.0, entropy=None):
    """The backward's per-row coefficients a, b, c (see kernels/cross_entropy.py) for
    cotangents g of the loss and g_lse of lse; with ``entropy`` = (g_h, logsum, h), the
    cotangent g_h of the entropy h, also d (a, b, c, d)."""
    ignored = labels == ignore_index
    outside = ~ignored & ((labels < 0) | (labels >= n))
    g = jnp.where(ignored, 0.0, g)
    a = g + g_lse + (jnp.where(g == 0, 0.0, 2.0 * z_loss * g * lse) if z_loss else 0.0)
    b = g * (1.0 - smoothing)
    c = jnp.where(outside & (g != 0), jnp.nan, g * (smoothing / n))
    if entropy is None:
        return a, b, c
    # dh/dz = -p * (u - (logsum - h)), u = z - shift
    g_h, logsum, h = entropy
    g_h = jnp.where(ignored, 0.0, g_h)
    return a + jnp.where(g_h == 0, 0.0, g_h * (logsum - h)), b, c, -g_h


@dataclasses.dataclass(frozen=True)
class CrossEntropyForward(KernelConfig):
    """Per-row loss and statistics, and with ``grad`` the gradient of ``sum(w * loss)``."""

    kernel_class = "cross_entropy:CrossEntropyForward"
    kernels: ClassVar[dict] = {"cross_entropy_fwd": {}}
    smoothing: bool = option(False)
    softcap: bool = option(False)
    grad: bool = option(False)
    entropy: bool = option(False)
    ignore_index: int = scalar(-100)
    label_smoothing: float = scalar(0.0, kernel="smoothing")
    z_loss: float = scalar(0.0)
    cap: float = scalar(0.0)
    inv_temperature: float = scalar(1.0)


@dataclasses.dataclass(frozen=True)
class CrossEntropyBackward(KernelConfig):
    """dlogits from the logits, the row statistics and per-row coefficients."""

    kernel_class = "cross_entropy:CrossEntropyBackward"
    kernels: ClassVar[dict] = {"cross_entropy_bwd": {}}
    softcap: bool = option(False)
    entropy: bool = option(False)
    cap: float = scalar(0.0)
    inv_temperature: float = scalar(1.0)


# -- forward: (logits, labels, [w]) -> (loss, shift, logsum, [entropy], [dlogits]) ---
# Of z = softcap(logits) / temperature. With ``entropy`` (not with ``grad`` or label
# smoothing), the rows' softmax entropy, whatever their label. With ``grad``, dlogits is
# the gradient of sum(w * loss) for per-row weights w. With
# ``inplace`` (and ``grad``), the kernel writes dlogits over the logits: one buffer for
# both, for callers whose logits are a temporary (linear_cross_entropy). The reference
# ignores it (XLA reuses dead buffers itself).


def _pick(x, columns):
    """x at each row's column (clipped into the row: the caller masks the outside ones)."""
    index = jnp.clip(columns, 0, x.shape[-1] - 1)[..., None]
    return jnp.take_along_axis(x, index, axis=-1)[..., 0]


def _row_loss(shift, logsum, target, mean, labels, n, *, ignore_index, smoothing, z_loss):
    """The kernel's loss of each row from its statistics, target logit and ``mean()`` of
    its (softcapped) logits; 0 where the label is ignored, NaN where it is outside [0, n).
    The logits enter only as differences from shift, which are exact."""
    loss = logsum + (1.0 - smoothing) * (shift - target)
    if z_loss:
        loss = loss + z_loss * (shift + logsum) ** 2
    if smoothing:
        loss = loss + smoothing * (shift - mean())
    inside = (labels >= 0) & (labels < n)
    return jnp.where(labels == ignore_index, 0.0, jnp.where(inside, loss, jnp.nan))


def _rows(logits, labels, cfg):
    """The XLA formulation of the rows' loss and statistics, which JAX can differentiate
    (``implementation="xla"``)."""
    ignore_index, smoothing, z_loss, softcap, temperature = cfg
    x, _ = _tempered(logits, softcap, temperature)
    shift, logsum = _row_stats(x)
    loss = _row_loss(
        shift,
        logsum,
        _pick(x, labels),
        lambda: jnp.mean(x, axis=-1),
        labels,
        x.shape[-1],
        ignore_index=ignore_index,
        smoothing=smoothing,
        z_loss=z_loss,
    )
    return loss.astype(shift.dtype), shift, logsum


def _entropy(z, shift, logsum, row=WHOLE):
    """The rows' softmax entropy ``lse - sum(p * z)`` from their statistics, computed as
    ``logsum - sum(p * (z - shift))`` (the terms of -inf logits count 0)."""
    p = jnp.exp((z - shift[..., None]) - logsum[..., None])
    return logsum - _masked_sum(p, z - shift[..., None], row)


def _reference_forward(
    *operands, ignore_index, smoothing, z_loss, softcap, temperature, entropy, grad, inplace
):
    logits, labels = operands[:2]
    cfg = (ignore_index, smoothing, z_loss, softcap, temperature)
    loss, shift, logsum = _rows(logits, labels, cfg)
    n = logits.shape[-1]
    outs = [loss, shift, logsum]
    if entropy:
        outs.append(_entropy(_tempered(logits, softcap, temperature)[0], shift, logsum))
    if grad:
        lse = shift + logsum
        a, b, c = _coefficients(labels, n, ignore_index, smoothing, z_loss, lse, operands[2])
        outs += _reference_backward(
            logits,
            labels,
            shift,
            logsum,
            a,
            b,
            c,
            softcap=softcap,
            temperature=temperature,
            entropy=False,
            inplace=inplace,
        )
    return outs


def _forward_abstract(x, *_, entropy, grad, **__):
    return [_row_stat(x)] * (3 + entropy) + [x.update(weak_type=False)] * grad


def _forward_kernel(
    target: Target,
    avals_in,
    avals_out,
    *,
    ignore_index,
    smoothing,
    z_loss,
    softcap,
    temperature,
    entropy,
    grad,
    inplace,
):
    x = avals_in[0]
    family = "ce_grad" if grad else "ce_entropy" if entropy else "ce_fwd"
    tiling = row_tiling(x, family, live=1 + bool(smoothing or entropy))
    if tiling is None:
        return None
    config = CrossEntropyForward(
        smoothing=bool(smoothing),
        softcap=softcap is not None,
        grad=grad,
        entropy=entropy,
        ignore_index=int(ignore_index),
        label_smoothing=float(smoothing),
        z_loss=float(z_loss),
        cap=float(softcap or 0.0),
        inv_temperature=1.0 / temperature,
    )
    aliases = {0: 3 + entropy} if inplace else None
    return kernel_call(target, config, x, tiling, avals_out, aliases=aliases)


_forward = RowwisePrimitive(
    "quack_jax_cross_entropy",
    kernel=_forward_kernel,
    reference=_reference_forward,
    abstract=_forward_abstract,
    roles=lambda *, entropy, grad, **_: (
        (ROWS, STAT) + (STAT,) * grad,
        (STAT,) * (3 + entropy) + (ROWS,) * grad,
    ),
    split=lambda *args, **params: _forward_split(*args, **params),
)


# -- backward: (logits, labels, shift, logsum, a, b, c, [d]) -> dlogits -------------
# ``entropy``: the coefficient d of the entropy's term. ``inplace``: dlogits is written
# over the logits, as in the forward.


def _reference_backward(
    logits, labels, shift, logsum, a, b, c, *d, softcap, temperature, entropy, inplace
):
    z, x = _tempered(logits, softcap, temperature)
    u = z - shift[..., None]
    p = jnp.exp(u - logsum[..., None])
    a, b, c, *d = (v[..., None] for v in (a, b, c, *d))
    hit = jnp.arange(x.shape[-1]) == labels[..., None]
    dx = jnp.where(a == 0, 0.0, a * p) - c - jnp.where(hit, b, 0.0)
    if entropy:
        dx = dx + jnp.where(p == 0, 0.0, d[0] * p * u)
    dx = dx / temperature
    if softcap is not None:
        dead = (a == 0) & (b == 0) & (c == 0) & (d[0] == 0 if entropy else True)
        dx = jnp.where(dead, 0.0, dx * (1.0 - (x / softcap) ** 2))
    return [dx.astype(logits.dtype)]


def _backward_kernel(
    target: Target, avals_in, avals_out, *, softcap, temperature, entropy, inplace
):
    x = avals_in[0]
    tiling = row_tiling(x, "ce_bwd")
    if tiling is None:
        return None
    config = CrossEntropyBackward(
        softcap=softcap is not None,
        entropy=entropy,
        cap=float(softcap or 0.0),
        inv_temperature=1.0 / temperature,
    )
    aliases = {0: 0} if inplace else None
    return kernel_call(target, config, x, tiling, avals_out, cluster=False, aliases=aliases)


_backward = RowwisePrimitive(
    "quack_jax_cross_entropy_backward",
    kernel=_backward_kernel,
    reference=_reference_backward,
    roles=lambda *, entropy, **_: ((ROWS,) + (STAT,) * (6 + entropy), (ROWS,)),
    split=lambda *args, **params: _backward_split(*args, **params),
)


# -- forward mode: (t, logits, labels, shift, logsum, [entropy]) -> (loss tangent, lse
# tangent, [entropy tangent]). Linear in t, the logits' tangent; its transpose is the
# backward kernel. It runs XLA everywhere (a per-row reduction of t against the
# softmax); on a vocabulary split, over each device's slice with psums (``row``).


def _reference_tangent(
    t,
    logits,
    labels,
    shift,
    logsum,
    *h,
    ignore_index,
    smoothing,
    z_loss,
    softcap,
    temperature,
    entropy,
    row=WHOLE,
):
    z, x = _tempered(logits, softcap, temperature)
    tx = t.astype(x.dtype) / temperature
    if softcap is not None:
        tx = tx * (1.0 - (x / softcap) ** 2)
    u = z - shift[..., None]
    p = jnp.exp(u - logsum[..., None])
    t_lse = row.sum(p * tx)[..., 0]
    width = x.shape[-1]
    here = labels - row.start(width)
    held = (here >= 0) & (here < width)
    t_target = row.sum(jnp.where(held, _pick(tx, here), 0.0)[..., None])[..., 0]
    t_loss = t_lse - (1.0 - smoothing) * t_target
    if z_loss:
        t_loss = t_loss + 2.0 * z_loss * (shift + logsum) * t_lse
    if smoothing:
        t_loss = t_loss - smoothing * row.mean(tx)[..., 0]
    inside = (labels >= 0) & (labels < width * row.count)
    t_loss = jnp.where(labels == ignore_index, 0.0, jnp.where(inside, t_loss, jnp.nan))
    if not entropy:
        return [t_loss, t_lse]
    # dh = -sum(p * (u - (logsum - h)) * tz)
    t_h = -_masked_sum(p, (u - (logsum - h[0])[..., None]) * tx, row)
    return [t_loss, t_lse, t_h]


def _tangent_transpose(
    cts, t, logits, labels, shift, logsum, *h, softcap, temperature, entropy, **cfg
):
    assert ad.is_undefined_primal(t) and not ad.is_undefined_primal(logits)
    g_loss, g_lse, *g_h = (ad.instantiate_zeros(ct) for ct in cts)
    n = logits.shape[-1]
    args = (cfg["ignore_index"], cfg["smoothing"], cfg["z_loss"], shift + logsum)
    terms = (g_h[0], logsum, h[0]) if entropy else None
    coefficients = _coefficients(labels, n, *args, g_loss, g_lse, terms)
    (dt,) = _backward.bind(
        logits,
        labels,
        shift,
        logsum,
        *coefficients,
        softcap=softcap,
        temperature=temperature,
        entropy=entropy,
        inplace=False,
    )
    return [dt] + [None] * (4 + entropy)


_tangent = RowwisePrimitive(
    "quack_jax_cross_entropy_tangent",
    kernel=lambda *_, **__: None,
    reference=_reference_tangent,
    abstract=lambda t, x, *_, entropy, **__: [_row_stat(x)] * (2 + entropy),
    transpose=_tangent_transpose,
    roles=lambda *, entropy, **_: ((ROWS, ROWS) + (STAT,) * (3 + entropy), (STAT,) * (2 + entropy)),
)


# -- a vocabulary split across devices (a tensor-parallel LM head) -------------------


def _forward_split(
    row, *, ignore_index, smoothing, z_loss, softcap, temperature, entropy, grad, inplace
):
    """The forward on one device's slice of the vocabulary (``row``): the slices'
    statistics (and entropies) combined with pmax and psum, the target logit from the
    slice that holds it, then the loss. With ``grad``, the gradient comes from the
    backward kernel on the slice, which needs the combined statistics. For a whole row,
    the forward kernel alone."""
    axes = row.axes
    cfg = (ignore_index, smoothing, z_loss, softcap, temperature)

    def local(logits, labels, *weights):
        if not axes:
            return _bind_forward(logits, labels, cfg, *weights, entropy=entropy, inplace=inplace)
        width = logits.shape[-1]
        n = width * row.count
        here = labels - row.start(width)
        _, shift_slice, logsum_slice, *h_slice = _forward.bind(
            logits,
            jnp.full_like(labels, ignore_index),
            ignore_index=ignore_index,
            smoothing=0.0,
            z_loss=0.0,
            softcap=softcap,
            temperature=temperature,
            entropy=entropy,
            grad=False,
            inplace=False,
        )
        # the slices' shifts are finite: the row's is their max, and each slice's sum of
        # exponentials is rescaled to it
        shift = jax.lax.pmax(shift_slice, axes)
        logsum = jnp.log(jax.lax.psum(jnp.exp(shift_slice - shift + logsum_slice), axes))
        z, _ = _tempered(logits, softcap, temperature)
        held = (here >= 0) & (here < width)
        target = jax.lax.psum(jnp.where(held, _pick(z, here), 0.0), axes)
        loss = _row_loss(
            shift,
            logsum,
            target,
            lambda: row.mean(z)[..., 0],
            labels,
            n,
            ignore_index=ignore_index,
            smoothing=smoothing,
            z_loss=z_loss,
        )
        outs = [loss, shift, logsum]
        if entropy:
            # h = logsum - sum over slices of their share of p times E_slice[z] - shift
            share = jnp.exp(shift_slice - shift + logsum_slice - logsum)
            centre = (shift_slice - shift) + (logsum_slice - h_slice[0])
            outs.append(logsum - jax.lax.psum(jnp.where(share > 0, share * centre, 0.0), axes))
        if grad:
            lse = shift + logsum
            a, b, c = _coefficients(labels, n, ignore_index, smoothing, z_loss, lse, weights[0])
            outs += _backward.bind(
                logits,
                here,
                shift,
                logsum,
                a,
                b,
                c,
                softcap=softcap,
                temperature=temperature,
                entropy=False,
                inplace=inplace,
            )
        return outs

    return local


def _backward_split(row, *, softcap, temperature, entropy, inplace):
    """The backward on one device's slice: the label's column counted from the slice."""

    def local(logits, labels, *stats_and_coefficients):
        here = labels - row.start(logits.shape[-1])
        return _backward.bind(
            logits,
            here,
            *stats_and_coefficients,
            softcap=softcap,
            temperature=temperature,
            entropy=entropy,
            inplace=inplace,
        )

    return local


# -- differentiation ----------------------------------------------------------------
# ``custom_jvp``s whose tangents are linear in the logits' tangent, so that reverse mode
# transposes them and forward mode runs them. Per-row losses (reduction "none", or lse
# wanted): the tangent is ``_tangent``, whose transpose is the backward kernel, which
# reads the logits again once the cotangents are known. A sum or mean alone: its rows'
# cotangents are known up to one scalar factor in the forward, which writes the gradient
# from the row in registers; the tangent is its inner product with the logits' tangent,
# whose transpose scales it (a multiply by 1 under jax.grad, which XLA removes).


def _bind_forward(logits, labels, cfg, *weights, entropy=False, inplace=False):
    """The forward of options ``cfg``; with per-row ``weights``, also the gradient."""
    ignore_index, smoothing, z_loss, softcap, temperature = cfg
    return _forward.bind(
        logits,
        labels,
        *weights,
        ignore_index=ignore_index,
        smoothing=smoothing,
        z_loss=z_loss,
        softcap=softcap,
        temperature=temperature,
        entropy=entropy,
        grad=bool(weights),
        inplace=inplace,
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _per_row(logits, labels, cfg, entropy):
    """The rows' loss and lse, and with ``entropy`` their softmax entropy."""
    loss, shift, logsum, *h = _bind_forward(logits, labels, cfg, entropy=entropy)
    return (loss, shift + logsum, *h)


@_per_row.defjvp
def _per_row_jvp(cfg, entropy, primals, tangents):
    logits, labels = primals
    ignore_index, smoothing, z_loss, softcap, temperature = cfg
    loss, shift, logsum, *h = _bind_forward(logits, labels, cfg, entropy=entropy)
    tangent = _tangent.bind(
        tangents[0],
        logits,
        labels,
        shift,
        logsum,
        *h,
        ignore_index=ignore_index,
        smoothing=smoothing,
        z_loss=z_loss,
        softcap=softcap,
        temperature=temperature,
        entropy=entropy,
    )
    return (loss, shift + logsum, *h), tuple(tangent)


def _row_weights(labels, ignore_index, mean: bool):
    """The rows' share of a sum (1) or mean (1 / rows not ignored); 0 where ignored."""
    kept = labels != ignore_index
    share = 1.0 / jnp.sum(kept).astype(jnp.float32) if mean else 1.0
    return jnp.where(kept, share, 0.0).astype(jnp.float32)


def _reduce(loss, labels, ignore_index, mean: bool):
    """The sum of the rows' losses (ignored rows hold 0), or their mean over the rows not
    ignored (NaN when there are none)."""
    total = jnp.sum(loss)
    return total / jnp.sum(labels != ignore_index).astype(loss.dtype) if mean else total


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _reduced(logits, labels, cfg, mean):
    loss, *_ = _bind_forward(logits, labels, cfg)
    return _reduce(loss, labels, cfg[0], mean)


@_reduced.defjvp
def _reduced_jvp(cfg, mean, primals, tangents):
    logits, labels = primals
    weights = _row_weights(labels, cfg[0], mean)
    loss, _, _, dlogits = _bind_forward(logits, labels, cfg, weights)
    dtype = compute_dtype(logits.dtype)
    tangent = jnp.sum(dlogits.astype(dtype) * tangents[0].astype(dtype))
    return _reduce(loss, labels, cfg[0], mean), tangent


# -- the public functions -----------------------------------------------------------


def finish(loss, lse, labels, cfg, reduction, return_lse):
    """The per-row ``loss`` reduced as asked, with ``lse`` if asked."""
    if reduction != "none":
        loss = _reduce(loss, labels, cfg[0], reduction == "mean")
    return (loss, lse) if return_lse else loss


def xla_formulation(logits, labels, cfg, reduction, return_lse):
    """The cross-entropy as plain XLA that JAX differentiates (``implementation="xla"``)."""
    loss, shift, logsum = _rows(logits, labels, cfg)
    return finish(loss, shift + logsum, labels, cfg, reduction, return_lse)


def checked_temperature(fn, temperature) -> float:
    """``temperature`` as a Python float, positive, finite and with a finite float32
    reciprocal (the kernels take 1 / temperature)."""
    temperature = static_float(fn, "temperature", temperature, positive=True)
    if temperature < 1.0 / float(np.finfo(np.float32).max):
        raise ValueError(f"{fn}: temperature must be at least 3e-38, got {temperature}")
    return temperature


def options(
    fn, ignore_index, reduction, label_smoothing, z_loss, logit_softcap, return_lse, temperature
):
    """The checked options of a cross-entropy, as ``(ignore_index, label_smoothing,
    z_loss, logit_softcap, temperature)``; errors name ``fn`` and the argument."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(
            f"{fn}: ignore_index must be a Python int, got {type(ignore_index).__name__}"
        )
    if not _INT32.min <= ignore_index <= _INT32.max:
        raise ValueError(f"{fn}: ignore_index must fit in int32, got {ignore_index}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    smoothing = static_float(fn, "label_smoothing", label_smoothing, low=0.0, high=1.0)
    z_loss = static_float(fn, "z_loss", z_loss, low=0.0)
    softcap = None
    if logit_softcap is not None:
        softcap = static_float(fn, "logit_softcap", logit_softcap, positive=True)
    if not isinstance(return_lse, bool):
        raise TypeError(f"{fn}: return_lse must be a bool, got {type(return_lse).__name__}")
    return (int(ignore_index), smoothing, z_loss, softcap, checked_temperature(fn, temperature))


def labels_of(fn: str, labels, shape) -> jax.Array:
    """``labels`` as int32 of the logits' leading shape; values beyond int32 are clipped
    (they stay out of range)."""
    if not (hasattr(labels, "shape") and hasattr(labels, "dtype")):
        raise TypeError(
            f"{fn}: labels must be an integer array (jax.Array or numpy.ndarray), "
            f"got {type(labels).__name__}"
        )
    dtype = np.dtype(labels.dtype)
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{fn}: labels must have an integer dtype (any width), got {dtype.name}")
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(
            f"{fn}: labels must have the logits' leading shape {tuple(shape)}, "
            f"got {tuple(labels.shape)}"
        )
    labels = jnp.asarray(labels)
    if dtype.itemsize >= 4 and dtype != np.int32:
        if np.issubdtype(dtype, np.unsignedinteger):
            labels = jnp.minimum(labels, _INT32.max)
        else:
            labels = jnp.clip(labels, _INT32.min, _INT32.max)
    return labels.astype(jnp.int32)


def cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcap: float | None = None,
    temperature: float = 1.0,
    return_lse: bool = False,
    implementation: str | None = None,
):
    """Softmax cross-entropy with integer labels over the last axis of ``logits``.

    With ``x = logit_softcap * tanh(logits / logit_softcap) / temperature`` (or the
    logits, over the temperature) and ``lse = logsumexp(x)``, the loss of a row is
    ``lse - (1 - label_smoothing) * x[label] - label_smoothing * mean(x) + z_loss * lse**2``
    (PyTorch's label smoothing; PaLM's z-loss; Gemma 2's softcap).

    Args:
      logits: array (..., V), float32, bfloat16 or float16 (float64 runs the XLA
        reference). Math is in float32.
      labels: integer array of shape ``logits.shape[:-1]``.
      ignore_index: rows with this label have loss 0 and gradient 0 and do not count
        towards "mean".
      reduction: "none" (per-row losses, the leading shape), "sum", or "mean" (the sum
        divided by the number of rows not ignored: NaN when all are ignored, as in
        PyTorch).
      label_smoothing: in [0, 1).
      z_loss: coefficient of ``lse**2``, >= 0.
      logit_softcap: None, or a positive cap applied to the logits first.
      temperature: positive; the (softcapped) logits are divided by it (a sampling
        temperature; the kernels scale their exponent, at no cost).
      return_lse: also return the per-row lse (of every row, ignored ones too).
      implementation: None (the kernels on a CUDA sm_90 device, the XLA fallback
        elsewhere) or "xla": a plain jnp formulation that JAX differentiates, with no
        quack_jax primitive in the program (to bisect a numerics difference). None
        follows ``$QUACK_JAX_IMPLEMENTATION`` (``xla`` or unset), read at trace time.

    Returns:
      the loss in float32 (float64 for float64 logits), and with ``return_lse`` the
      tuple ``(loss, lse)``.

    A label outside [0, V) other than ``ignore_index`` gives a NaN loss (and NaN
    gradient) for its row; it is never read out of bounds. NaN logits give a NaN loss
    for their row; a row with +inf logits has lse +inf. The softmax is
    ``exp(x - max - log(sum(exp(x - max))))``, never ``exp(x - lse)``, so large logits
    keep their precision. ``jax.grad`` of a sum or mean takes the gradient that the
    forward kernel writes; of per-row losses or lse, one backward kernel that reads the
    logits and writes their gradient in their dtype. ``jax.jvp`` and ``jax.jacfwd`` run the
    forward kernel and an XLA reduction of the tangent.
    """
    fn = "cross_entropy"
    logits = float_array(fn, "logits", logits)
    labels = labels_of(fn, labels, logits.shape[:-1])
    cfg = options(
        fn, ignore_index, reduction, label_smoothing, z_loss, logit_softcap, return_lse, temperature
    )
    if use_xla(fn, implementation):
        return xla_formulation(logits, labels, cfg, reduction, return_lse)
    if reduction != "none" and not return_lse:
        return _reduced(logits, labels, cfg, reduction == "mean")
    loss, lse = _per_row(logits, labels, cfg, False)
    return finish(loss, lse, labels, cfg, reduction, return_lse)


def token_logprobs(
    logits: jax.Array,
    labels: jax.Array,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    logit_softcap: float | None = None,
    ignore_index: int | None = None,
    implementation: str | None = None,
):
    """The log-probability of each row's label under ``softmax(z)``, and with
    ``return_entropy`` the softmax's entropy, over the last axis: what RL fine-tuning
    (PPO, GRPO) and distillation read from the vocabulary.

    With ``z = logit_softcap * tanh(logits / logit_softcap) / temperature`` (or the
    logits over the temperature), ``logp = z[label] - logsumexp(z)`` and
    ``entropy = logsumexp(z) - sum(softmax(z) * z)``, both from one read of the logits,
    in float32. ``jax.grad`` of any function of them runs one backward kernel (one read of
    the logits, one write of their gradient) for the cotangents of both:
    ``d logp / d logits = (onehot - p) / T`` and ``d entropy / d logits =
    -p * (z - E_p[z]) / T`` (times the softcap's derivative).

    Args:
      logits: array (..., V), float32, bfloat16 or float16 (float64 runs the XLA
        reference).
      labels: integer array of shape ``logits.shape[:-1]``: the sampled tokens.
      temperature: positive: the sampling temperature.
      return_entropy: also return the entropy of each row.
      logit_softcap: None, or a positive cap applied to the logits first.
      ignore_index: None (every row counts), or the label of rows to ignore (padding):
        their logp and entropy are 0, and so are their gradients.
      implementation: as in :func:`cross_entropy`.

    Returns:
      logp, float32 of the leading shape (float64 for float64 logits), and with
      ``return_entropy`` the tuple ``(logp, entropy)``.

    A label outside [0, V) (and not ``ignore_index``) gives a NaN logp for its row (its
    entropy is still the row's). Logits of -inf (masked vocabulary entries) have p = 0
    and add 0 to the entropy; a row of only -inf logits gives NaN.
    """
    fn = "token_logprobs"
    logits = float_array(fn, "logits", logits)
    labels, cfg = logprob_options(
        fn, logits.shape, labels, temperature, return_entropy, logit_softcap, ignore_index
    )
    if use_xla(fn, implementation):
        loss, shift, logsum = _rows(logits, labels, cfg)
        z, _ = _tempered(logits, softcap=cfg[3], temperature=cfg[4])
        h = [_entropy(z, shift, logsum)] if return_entropy else []
    else:
        loss, _, *h = _per_row(logits, labels, cfg, return_entropy)
    return logprob_outputs(loss, h, labels, cfg)


def logprob_options(fn, shape, labels, temperature, return_entropy, logit_softcap, ignore_index):
    """The checked labels (int32 of the leading ``shape``) and options (see ``options``)
    of a token_logprobs over rows of ``shape[-1]``. With ``ignore_index`` None no row is
    ignored: negative labels (out of range anyway) go to V, and -1 is the ignore_index,
    which then matches none."""
    labels = labels_of(fn, labels, shape[:-1])
    if ignore_index is None:
        labels = jnp.where(labels < 0, shape[-1], labels)
        ignore_index = -1
    if not isinstance(return_entropy, bool):
        raise TypeError(f"{fn}: return_entropy must be a bool, got {type(return_entropy).__name__}")
    return labels, options(fn, ignore_index, "none", 0.0, 0.0, logit_softcap, False, temperature)


def logprob_outputs(loss, h, labels, cfg):
    """logp (-loss), and the entropy if ``h`` holds it, 0 on ignored rows."""
    ignored = labels == cfg[0]
    outs = tuple(jnp.where(ignored, 0.0, v).astype(loss.dtype) for v in (-loss, *h))
    return outs if h else outs[0]


def _class_axes(fn: str, axis, ndim: int) -> tuple[int, ...]:
    """``axis`` (an int, or a tuple of ints as optax takes it) as axes in [0, ndim), in
    the order given: the order in which a label indexes the flattened class axes."""
    allowed = "an int or a tuple of ints"
    if not isinstance(axis, tuple):
        return (axis_index(fn, axis, ndim, allowed),)
    axes = tuple(axis_index(fn, a, ndim, allowed) for a in axis)
    if len(set(axes)) < len(axes):
        raise ValueError(f"{fn}: axis must name each axis once, got {axis}")
    return axes


def softmax_cross_entropy_with_integer_labels(
    logits: jax.Array,
    labels: jax.Array,
    axis: int | tuple[int, ...] = -1,
    where: jax.Array | None = None,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """``optax.softmax_cross_entropy_with_integer_labels`` on quack_jax's kernels.

    The same per-example loss ``logsumexp(logits) - logits[label]`` (no ignore index, no
    reduction) in the logits' dtype (computed in float32), the same label handling (a
    label in [-V, 0) counts from the end, as ``jnp.take_along_axis`` does; any other
    label outside [0, V) gives NaN) and the same ``where``: of the labels' shape, it sets
    the loss of rows where it is False to 0; of the logits' shape, it masks logits out of
    the logsumexp (that case runs optax's XLA formulation). ``axis`` is the class axis,
    or a tuple of them: their V elements are the classes, a label a flat (C-order) index
    into them in the order given, and the labels have the shape of the other axes. The
    kernels take the class axes last, merged into one, so other axes cost a transpose.
    ``implementation`` as in :func:`cross_entropy`.
    """
    fn = "softmax_cross_entropy_with_integer_labels"
    logits = float_array(fn, "logits", logits)
    shape = logits.shape
    axes = _class_axes(fn, axis, logits.ndim)
    batch = tuple(a for a in range(logits.ndim) if a not in axes)
    lead = tuple(shape[a] for a in batch)
    n = math.prod(shape[a] for a in axes)

    def rows(a):
        """``a`` of the logits' shape with the class axes last, merged into one."""
        return jnp.transpose(a, batch + axes).reshape(*lead, n)

    logits = rows(logits)
    labels = labels_of(fn, labels, lead)
    if where is not None and jnp.ndim(where) == len(shape):
        where = rows(jnp.broadcast_to(where, shape))
        lse = jax.nn.logsumexp(logits.astype(compute_dtype(logits.dtype)), axis=-1, where=where)
        target = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return jnp.where(jnp.any(where, axis=-1), lse - target, 0.0).astype(logits.dtype)
    wrapped = jnp.where(labels < 0, labels + n, labels)
    wrapped = jnp.where((wrapped < 0) | (wrapped >= n), n, wrapped)
    loss = cross_entropy(
        logits, wrapped, ignore_index=-1, reduction="none", implementation=implementation
    )
    if where is not None:
        if jnp.shape(where) != labels.shape:
            raise ValueError(
                f"{fn}: where must have the labels' shape {labels.shape} or the logits' "
                f"shape, got {jnp.shape(where)}"
            )
        loss = jnp.where(where, loss, 0.0)
    return loss.astype(logits.dtype)


def _lowerings(op: str, dtype: str, n: int, packaged: bool):
    """cross_entropy: with each kernel variant (label smoothing or not, softcap or not;
    ``packaged``: neither), the gradient of the mean loss (one forward kernel that writes
    the gradient), and the per-row losses and lse under ``jax.vjp`` (forward and
    backward kernels). token_logprobs: under ``jax.vjp``, with the entropy, without
    a softcap (``packaged``), or with and without either."""
    args = (jax.ShapeDtypeStruct((8, n), dtype), jax.ShapeDtypeStruct((8,), "int32"))
    if op == "token_logprobs":
        for entropy in (True,) if packaged else (True, False):
            for softcap in (None,) if packaged else (None, 30.0):
                options = dict(return_entropy=entropy, logit_softcap=softcap)

                def rows(x, labels, options=options):
                    out, vjp = jax.vjp(lambda x: token_logprobs(x, labels, **options), x)
                    return out, vjp(out)

                yield rows, args
        return
    for smoothing in (0.0,) if packaged else (0.0, 0.1):
        for softcap in (None,) if packaged else (None, 30.0):
            options = dict(label_smoothing=smoothing, logit_softcap=softcap)

            def mean(x, labels, options=options):
                return jax.value_and_grad(lambda x: cross_entropy(x, labels, **options))(x)

            def rows(x, labels, options=options):
                def f(x):
                    return cross_entropy(x, labels, reduction="none", return_lse=True, **options)

                out, vjp = jax.vjp(f, x)
                return out, vjp(out)

            yield mean, args
            yield rows, args


def _benchmarks():
    """The mean loss over labels uniform in [0, N): forward, and ``jax.grad`` w.r.t. the
    logits; against optax's formulation (logsumexp - target logit) in float32. The
    arguments are the logits, the labels and dy (unused: the loss is a scalar)."""
    shapes = [(32768, 1024), (8192, 32000), (8192, 50257), (4096, 128256), (4096, 151936)]
    shapes += [(2048, 262144)]

    def quack(logits, labels):
        return cross_entropy(logits, labels)

    def xla(logits, labels):
        x = logits.astype(jnp.float32)
        target = jnp.take_along_axis(x, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(x, axis=-1) - target)

    def logits_labels(x, labels, dy):
        return x, labels

    return [
        Benchmark(
            "cross_entropy",
            shapes,
            quick_shapes=[(1024, 1024), (128, 32000)],
            arguments=lambda m, n, dtype: [((m, n), dtype), ((m,), "int32", n), ((m, n), dtype)],
            cases=[
                Case("quack_fwd", "quack_jax fwd", 1, quack, -1, kernel=True),
                Case("xla_fwd", "XLA fwd", 1, xla, -1),
                Case("quack_fwd_bwd", "quack_jax fwd+bwd", 2, jax.grad(quack), -1, kernel=True),
                Case("xla_fwd_bwd", "XLA fwd+bwd", 2, jax.grad(xla), -1),
            ],
            tuned=[
                Tuned("fwd", "ce_fwd", 1, quack, logits_labels),
                Tuned("bwd", "ce_bwd", 2, *_tuned_backward(entropy=False)),
                # the forward that also writes the gradient (a mean loss under jax.grad)
                Tuned("grad", "ce_grad", 2, jax.grad(quack), logits_labels),
            ],
            columns=[*FWD_COLUMNS, *FWD_BWD_COLUMNS, TILINGS],
            footprint=4,
            latency_shapes=Benchmark.latency((32000, 128256, 256000)),  # vocabularies
        ),
        _token_logprobs_benchmark(),
    ]


def _tuned_backward(entropy, temperature=1.0):
    """The backward kernel alone, for the tuner: the function it times (every
    coefficient nonzero) and its operands from the benchmark's arguments."""

    def backward(logits, labels, shift, logsum, coefficient):
        coefficients = (coefficient,) * (3 + entropy)  # a, b, c and the entropy's d
        return _backward.bind(
            logits,
            labels,
            shift,
            logsum,
            *coefficients,
            softcap=None,
            temperature=temperature,
            entropy=entropy,
            inplace=False,
        )[0]

    def operands(logits, labels, *_):
        shift, logsum = _row_stats(logits.astype(jnp.float32) / temperature)
        return logits, labels, shift, logsum, jnp.full(shift.shape, 1.0 / shift.size, jnp.float32)

    return backward, operands


def _token_logprobs_benchmark(temperature=0.7):
    """token_logprobs with the entropy at a sampling temperature, against the plain-JAX
    formulation (log_softmax of logits / T, a gather, -sum(p * logp)) and against
    cross_entropy's per-row losses at the same temperature: forward, and ``jax.vjp``
    with cotangents for every output. Bytes: forward M*N*e (read the logits),
    fwd+bwd 3*M*N*e (the forward's read, the backward's read and write)."""

    def quack(logits, labels):
        return token_logprobs(logits, labels, temperature=temperature, return_entropy=True)

    def xla(logits, labels):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
        target = jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]
        return target, -jnp.sum(jnp.exp(logp) * logp, axis=-1)

    def ce(logits, labels):
        return cross_entropy(logits, labels, reduction="none", temperature=temperature)

    def vjp(fn):
        def f(logits, labels, g_logp, g_h):
            out, pullback = jax.vjp(lambda x: fn(x, labels), logits)
            return out, pullback((g_logp, g_h) if isinstance(out, tuple) else g_logp)

        return f

    return Benchmark(
        "token_logprobs",
        [(8192, 152064), (4096, 256000)],
        quick_shapes=[(128, 32000)],
        arguments=lambda m, n, dtype: [
            ((m, n), dtype),
            ((m,), "int32", n),
            ((m,), "float32"),
            ((m,), "float32"),
        ],
        cases=[
            Case("quack_fwd", "quack_jax fwd", 1, quack, 2, kernel=True),
            Case("xla_fwd", "XLA fwd", 1, xla, 2),
            Case("quack_fwd_bwd", "quack_jax fwd+bwd", 3, vjp(quack), kernel=True),
            Case("xla_fwd_bwd", "XLA fwd+bwd", 3, vjp(xla)),
            Case("ce_fwd", "cross_entropy fwd", 1, ce, 2, kernel=True),
            Case("ce_fwd_bwd", "cross_entropy fwd+bwd", 3, vjp(ce), kernel=True),
        ],
        tuned=[
            Tuned("fwd", "ce_entropy", 1, quack, lambda x, labels, *_: (x, labels)),
            Tuned("bwd", "ce_bwd", 2, *_tuned_backward(True, temperature)),
        ],
        columns=[
            *FWD_COLUMNS,
            *FWD_BWD_COLUMNS,
            ("cross_entropy fwd TB/s", "rate", "ce_fwd"),
            ("cross_entropy fwd+bwd TB/s", "rate", "ce_fwd_bwd"),
            ("fwd vs cross_entropy", "speedup", "ce_fwd", "quack_fwd"),
            ("fwd+bwd vs cross_entropy", "speedup", "ce_fwd_bwd", "quack_fwd_bwd"),
        ],
        footprint=8,
    )


SPEC = OpSpec(
    ops=("cross_entropy", "token_logprobs"),
    configs=(CrossEntropyForward, CrossEntropyBackward),
    sizes="vocab",
    lowerings=_lowerings,
    tests={
        "cpu": Shapes(rows=(1, 7), sizes=(2, 1000, 32000), special=(40,)),
        "gpu": Shapes(
            rows=(1, 7, 4096, 16384),
            sizes=(2, 1000, 32000, 50257, 128256, 151936, 262144),
            dtypes=("float32", "bfloat16"),
            special=(7, 1024, 65536),
        ),
    },
    benchmarks=_benchmarks,
)
