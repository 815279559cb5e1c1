"""The cross-entropy's formulas in jnp, which the XLA references of the primitives, the
plain-XLA formulation (``implementation="xla"``), the vocabulary split and linear +
cross-entropy share. Rows are reduced over their last axis, or with a ``Row`` over the
devices that split it (``_partition``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._partition import STAT, WHOLE, role_aval
from .._primitive import compute_dtype
from .options import CrossEntropyOptions


def tempered(logits, options: CrossEntropyOptions):
    """z: the (softcapped) logits over the temperature, and the softcapped logits."""
    x = logits.astype(compute_dtype(logits.dtype))
    cap = options.logit_softcap
    x = x if cap is None else cap * jnp.tanh(x / cap)
    return (x if options.temperature == 1.0 else x / options.temperature), x


def masked_sum(p, values, row=WHOLE):
    """sum(p * values) over the row, where terms with p = 0 count 0 (-inf logits; the
    select comes first, so that autodiff sees no 0 * inf either)."""
    return row.sum(p * jnp.where(p > 0, values, 0.0))[..., 0]


def row_stat(x):
    """The abstract value of one float32 (float64) statistic per row of ``x``."""
    return role_aval(x, STAT, compute_dtype(x.dtype))


def row_stats(z):
    """The row statistics of z (float32 or float64) as the kernels make them: shift, the
    max (0 where it is infinite or NaN), and ``logsum = log(sum(exp(z - shift)))``; their
    sum is logsumexp (docs/decisions/010-cross-entropy-row-statistics.md)."""
    top = jnp.max(z, axis=-1)
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    return shift, jnp.log(jnp.sum(jnp.exp(z - shift[..., None]), axis=-1))


def coefficients(labels, n, options: CrossEntropyOptions, lse, g, g_lse=0.0, entropy=None):
    """The backward's per-row coefficients a, b, c (see kernels/cross_entropy.py) for
    cotangents g of the loss and g_lse of lse; with ``entropy`` = (g_h, logsum, h), the
    cotangent g_h of the entropy h, also d (a, b, c, d)."""
    ignored = labels == options.ignore_index
    outside = ~ignored & ((labels < 0) | (labels >= n))
    label_smoothing, z_loss = options.label_smoothing, options.z_loss
    g = jnp.where(ignored, 0.0, g)
    a = g + g_lse + (jnp.where(g == 0, 0.0, 2.0 * z_loss * g * lse) if z_loss else 0.0)
    b = g * (1.0 - label_smoothing)
    c = jnp.where(outside & (g != 0), jnp.nan, g * (label_smoothing / n))
    if entropy is None:
        return a, b, c
    # dh/dz = -p * (u - (logsum - h)), u = z - shift
    g_h, logsum, h = entropy
    g_h = jnp.where(ignored, 0.0, g_h)
    return a + jnp.where(g_h == 0, 0.0, g_h * (logsum - h)), b, c, -g_h


def pick(x, columns):
    """x at each row's column (clipped into the row: the caller masks the outside ones)."""
    index = jnp.clip(columns, 0, x.shape[-1] - 1)[..., None]
    return jnp.take_along_axis(x, index, axis=-1)[..., 0]


def row_loss(shift, logsum, target, mean, labels, n, options: CrossEntropyOptions):
    """The kernel's loss of each row from its statistics, target logit and ``mean()`` of
    its (softcapped) logits; 0 where the label is ignored, NaN where it is outside [0, n).
    The logits enter only as differences from shift, which are exact."""
    label_smoothing, z_loss = options.label_smoothing, options.z_loss
    loss = logsum + (1.0 - label_smoothing) * (shift - target)
    if z_loss:
        loss = loss + z_loss * (shift + logsum) ** 2
    if label_smoothing:
        loss = loss + label_smoothing * (shift - mean())
    inside = (labels >= 0) & (labels < n)
    return jnp.where(labels == options.ignore_index, 0.0, jnp.where(inside, loss, jnp.nan))


def rows(logits, labels, options: CrossEntropyOptions):
    """The XLA formulation of the rows' loss and statistics, which JAX can differentiate
    (``implementation="xla"``)."""
    z, _ = tempered(logits, options)
    shift, logsum = row_stats(z)
    mean = functools.partial(jnp.mean, z, axis=-1)
    loss = row_loss(shift, logsum, pick(z, labels), mean, labels, z.shape[-1], options)
    return loss.astype(shift.dtype), shift, logsum


def entropy_of(z, shift, logsum, row=WHOLE):
    """The rows' softmax entropy ``lse - sum(p * z)`` from their statistics, computed as
    ``logsum - sum(p * (z - shift))`` (the terms of -inf logits count 0)."""
    p = jnp.exp((z - shift[..., None]) - logsum[..., None])
    return logsum - masked_sum(p, z - shift[..., None], row)


def row_weights(labels, ignore_index: int, mean: bool):
    """The rows' share of a sum (1) or mean (1 / rows not ignored); 0 where ignored."""
    kept = labels != ignore_index
    share = 1.0 / jnp.sum(kept).astype(jnp.float32) if mean else 1.0
    return jnp.where(kept, share, 0.0).astype(jnp.float32)


def reduce(loss, labels, ignore_index: int, mean: bool):
    """The sum of the rows' losses (ignored rows hold 0), or their mean over the rows not
    ignored (NaN when there are none)."""
    total = jnp.sum(loss)
    return total / jnp.sum(labels != ignore_index).astype(loss.dtype) if mean else total


def finish(loss, lse, labels, options: CrossEntropyOptions, reduction, return_lse):
    """The per-row ``loss`` reduced as asked, with ``lse`` if asked."""
    if reduction != "none":
        loss = reduce(loss, labels, options.ignore_index, reduction == "mean")
    return (loss, lse) if return_lse else loss


def xla_formulation(logits, labels, options: CrossEntropyOptions, reduction, return_lse):
    """The cross-entropy as plain XLA that JAX differentiates (``implementation="xla"``)."""
    loss, shift, logsum = rows(logits, labels, options)
    return finish(loss, shift + logsum, labels, options, reduction, return_lse)


def logprob_outputs(loss, h, labels, options: CrossEntropyOptions):
    """logp (-loss), and the entropy if ``h`` holds it, 0 on ignored rows."""
    ignored = labels == options.ignore_index
    outs = tuple(jnp.where(ignored, 0.0, v).astype(loss.dtype) for v in (-loss, *h))
    return outs if h else outs[0]
