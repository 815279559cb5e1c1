"""The cross-entropy's forward mode: (t, logits, labels, shift, logsum, [entropy]) ->
(loss tangent, lse tangent, [entropy tangent]). Linear in t, the logits' tangent; its
transpose is the backward kernel. It runs XLA everywhere (a per-row reduction of t
against the softmax); on a vocabulary split, over each device's slice with psums
(``row``)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.interpreters import ad

from .._partition import ROWS, STAT, WHOLE
from .._primitive import RowwisePrimitive
from .backward import backward
from .formulas import coefficients, masked_sum, pick, row_stat, tempered


def reference_tangent(t, logits, labels, shift, logsum, *h, options, entropy, row=WHOLE):
    z, x = tempered(logits, options)
    tx = t.astype(x.dtype) / options.temperature
    cap = options.logit_softcap
    if cap is not None:
        tx = tx * (1.0 - (x / cap) ** 2)
    u = z - shift[..., None]
    p = jnp.exp(u - logsum[..., None])
    t_lse = row.sum(p * tx)[..., 0]
    width = x.shape[-1]
    here = labels - row.start(width)
    held = (here >= 0) & (here < width)
    t_target = row.sum(jnp.where(held, pick(tx, here), 0.0)[..., None])[..., 0]
    label_smoothing, z_loss = options.label_smoothing, options.z_loss
    t_loss = t_lse - (1.0 - label_smoothing) * t_target
    if z_loss:
        t_loss = t_loss + 2.0 * z_loss * (shift + logsum) * t_lse
    if label_smoothing:
        t_loss = t_loss - label_smoothing * row.mean(tx)[..., 0]
    inside = (labels >= 0) & (labels < width * row.count)
    ignored = labels == options.ignore_index
    t_loss = jnp.where(ignored, 0.0, jnp.where(inside, t_loss, jnp.nan))
    if not entropy:
        return [t_loss, t_lse]
    # dh = -sum(p * (u - (logsum - h)) * tz)
    t_h = -masked_sum(p, (u - (logsum - h[0])[..., None]) * tx, row)
    return [t_loss, t_lse, t_h]


def _tangent_transpose(cts, t, logits, labels, shift, logsum, *h, options, entropy):
    assert ad.is_undefined_primal(t) and not ad.is_undefined_primal(logits)
    g_loss, g_lse, *g_h = (ad.instantiate_zeros(ct) for ct in cts)
    terms = (g_h[0], logsum, h[0]) if entropy else None
    n, lse = logits.shape[-1], shift + logsum
    coefficient = coefficients(labels, n, options, lse, g_loss, g_lse, terms)
    (dt,) = backward.bind(
        logits, labels, shift, logsum, *coefficient, options=options, entropy=entropy, inplace=False
    )
    return [dt] + [None] * (4 + entropy)


tangent = RowwisePrimitive(
    "quack_jax_cross_entropy_tangent",
    kernel=lambda *_, **__: None,
    reference=reference_tangent,
    abstract=lambda t, x, *_, entropy, **__: [row_stat(x)] * (2 + entropy),
    transpose=_tangent_transpose,
    roles=lambda *, entropy, **_: ((ROWS, ROWS) + (STAT,) * (3 + entropy), (STAT,) * (2 + entropy)),
)
