"""The cross-entropy forward primitive: (logits, labels, [w]) -> (loss, shift, logsum,
[entropy], [dlogits]), of z = softcap(logits) / temperature, from one read of the logits.

With ``entropy`` (not with ``grad`` or label smoothing), also the rows' softmax entropy,
whatever their label. With ``grad``, dlogits, the gradient of sum(w * loss) for per-row
weights w, written from the rows in registers
(docs/decisions/011-cross-entropy-forward-writes-gradient.md). With ``inplace`` (and
``grad``), the kernel writes dlogits over the logits: one buffer for both, for callers
whose logits are a temporary (linear + cross-entropy). The reference ignores it (XLA
reuses dead buffers itself)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .._partition import ROWS, STAT
from .._primitive import RowwisePrimitive, Target, kernel_call, row_tiling
from .backward import backward, reference_backward
from .config import CrossEntropyForward
from .formulas import coefficients, entropy_of, pick, row_loss, row_stat, rows, tempered
from .options import CrossEntropyOptions
from .tilings import forward_family


def reference_forward(*operands, options, entropy, grad, inplace):
    logits, labels = operands[:2]
    loss, shift, logsum = rows(logits, labels, options)
    outs = [loss, shift, logsum]
    if entropy:
        outs.append(entropy_of(tempered(logits, options)[0], shift, logsum))
    if grad:
        lse = shift + logsum
        a, b, c = coefficients(labels, logits.shape[-1], options, lse, operands[2])
        outs += reference_backward(
            logits, labels, shift, logsum, a, b, c, options=options, entropy=False, inplace=inplace
        )
    return outs


def _forward_abstract(x, *_, entropy, grad, **__):
    return [row_stat(x)] * (3 + entropy) + [x.update(weak_type=False)] * grad


def _forward_kernel(target: Target, avals_in, avals_out, *, options, entropy, grad, inplace):
    x = avals_in[0]
    family = forward_family(grad=grad, entropy=entropy)
    tiling = row_tiling(x, family, live=1 + bool(options.label_smoothing or entropy))
    if tiling is None:
        return None
    config = CrossEntropyForward.of(options, grad=grad, entropy=entropy)
    aliases = {0: 3 + entropy} if inplace else None
    return kernel_call(target, config, x, tiling, avals_out, aliases=aliases)


def partial_keys(options, entropy) -> tuple[str, ...]:
    """The names of ``partial_stats``'s parts, in order."""
    keys = ("shift", "logsum", "target") + ("entropy",) * entropy
    return keys + ("zsum",) * bool(options.label_smoothing)


def partial_stats(logits, here, options, entropy):
    """The statistics of one slice of each row's vocabulary, whose labels' columns are
    ``here`` (counted from the slice's first): its shift and logsum (and entropy) as
    if no label were in it, the target's z where the slice holds it (0 elsewhere), and
    with label smoothing the sum of its z. ``combined`` makes the rows' from them."""
    alone = dataclasses.replace(options, label_smoothing=0.0, z_loss=0.0)
    _, shift, logsum, *h = forward.bind(
        logits,
        jnp.full_like(here, options.ignore_index),
        options=alone,
        entropy=entropy,
        grad=False,
        inplace=False,
    )
    z, _ = tempered(logits, options)
    held = (here >= 0) & (here < logits.shape[-1])
    parts = {"shift": shift, "logsum": logsum, "target": jnp.where(held, pick(z, here), 0.0)}
    if entropy:
        parts["entropy"] = h[0]
    if options.label_smoothing:
        parts["zsum"] = jnp.sum(z, axis=-1)
    return parts


def combined(parts, labels, n, options, entropy, top, total):
    """The rows' (loss, shift, logsum, [entropy]) over a vocabulary of ``n`` from the
    ``partial_stats`` of its slices; ``top`` and ``total`` take the max and the sum of
    a part over the slices."""
    # the slices' shifts are finite: the row's is their max, and each slice's sum of
    # exponentials is rescaled to it
    shift = top(parts["shift"])
    logsum = jnp.log(total(jnp.exp(parts["shift"] - shift + parts["logsum"])))

    def mean():
        return total(parts["zsum"]) / n

    loss = row_loss(shift, logsum, total(parts["target"]), mean, labels, n, options)
    outs = [loss, shift, logsum]
    if entropy:
        # h = logsum - sum over slices of their share of p times E_slice[z] - shift
        share = jnp.exp(parts["shift"] - shift + parts["logsum"] - logsum)
        centre = (parts["shift"] - shift) + (parts["logsum"] - parts["entropy"])
        outs.append(logsum - total(jnp.where(share > 0, share * centre, 0.0)))
    return outs


def forward_split(row, *, options, entropy, grad, inplace):
    """The forward on one device's slice of the vocabulary (``row``): the slices'
    ``partial_stats`` combined with pmax and psum, then the loss. With ``grad``, the
    gradient comes from the backward kernel on the slice, which needs the combined
    statistics. For a whole row, the forward kernel alone."""
    axes = row.axes

    def local(logits, labels, *weights):
        if not axes:
            return bind_forward(logits, labels, options, *weights, entropy=entropy, inplace=inplace)
        n = logits.shape[-1] * row.count
        here = labels - row.start(logits.shape[-1])
        parts = partial_stats(logits, here, options, entropy)
        outs = combined(
            parts,
            labels,
            n,
            options,
            entropy,
            lambda v: jax.lax.pmax(v, axes),
            lambda v: jax.lax.psum(v, axes),
        )
        if grad:
            shift, logsum = outs[1:3]
            a, b, c = coefficients(labels, n, options, shift + logsum, weights[0])
            outs += backward.bind(
                logits,
                here,
                shift,
                logsum,
                a,
                b,
                c,
                options=options,
                entropy=False,
                inplace=inplace,
            )
        return outs

    return local


forward = RowwisePrimitive(
    "quack_jax_cross_entropy",
    kernel=_forward_kernel,
    reference=reference_forward,
    abstract=_forward_abstract,
    roles=lambda *, entropy, grad, **_: (
        (ROWS, STAT) + (STAT,) * grad,
        (STAT,) * (3 + entropy) + (ROWS,) * grad,
    ),
    split=forward_split,
)


def bind_forward(
    logits, labels, options: CrossEntropyOptions, *weights, entropy=False, inplace=False
):
    """The forward; with per-row ``weights``, also the gradient of sum(weights * loss)."""
    return forward.bind(
        logits,
        labels,
        *weights,
        options=options,
        entropy=entropy,
        grad=bool(weights),
        inplace=inplace,
    )
