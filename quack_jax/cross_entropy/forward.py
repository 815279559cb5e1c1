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


def forward_split(row, *, options, entropy, grad, inplace):
    """The forward on one device's slice of the vocabulary (``row``): the slices'
    statistics (and entropies) combined with pmax and psum, the target logit from the
    slice that holds it, then the loss. With ``grad``, the gradient comes from the
    backward kernel on the slice, which needs the combined statistics. For a whole row,
    the forward kernel alone."""
    axes = row.axes

    def local(logits, labels, *weights):
        if not axes:
            return bind_forward(logits, labels, options, *weights, entropy=entropy, inplace=inplace)
        width = logits.shape[-1]
        n = width * row.count
        here = labels - row.start(width)
        # the slice's statistics alone: no label is in it, no smoothing or z-loss
        alone = dataclasses.replace(options, label_smoothing=0.0, z_loss=0.0)
        _, shift_slice, logsum_slice, *h_slice = forward.bind(
            logits,
            jnp.full_like(labels, options.ignore_index),
            options=alone,
            entropy=entropy,
            grad=False,
            inplace=False,
        )
        # the slices' shifts are finite: the row's is their max, and each slice's sum of
        # exponentials is rescaled to it
        shift = jax.lax.pmax(shift_slice, axes)
        logsum = jnp.log(jax.lax.psum(jnp.exp(shift_slice - shift + logsum_slice), axes))
        z, _ = tempered(logits, options)
        held = (here >= 0) & (here < width)
        target = jax.lax.psum(jnp.where(held, pick(z, here), 0.0), axes)

        def mean():
            return row.mean(z)[..., 0]

        loss = row_loss(shift, logsum, target, mean, labels, n, options)
        outs = [loss, shift, logsum]
        if entropy:
            # h = logsum - sum over slices of their share of p times E_slice[z] - shift
            share = jnp.exp(shift_slice - shift + logsum_slice - logsum)
            centre = (shift_slice - shift) + (logsum_slice - h_slice[0])
            outs.append(logsum - jax.lax.psum(jnp.where(share > 0, share * centre, 0.0), axes))
        if grad:
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
