"""The per-row path over slices of the vocabulary (``Slices``), on one device's rows (and,
on a vocabulary split, its share of each slice). The forward pass makes each slice's
logits, their ``partial_stats``, and combines them into the rows' statistics; the last
``kept`` slices return their logits. The backward runs the backward kernel over each
slice's logits in place (those kept, then the others made again), sums dh over the
slices in float32 and writes each slice's dW whole, in the weight's dtype
(docs/decisions/028-per-row-losses-over-vocabulary-slices.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._partition import WHOLE, varying_like
from .._primitive import compute_dtype
from ..cross_entropy.backward import backward
from ..cross_entropy.forward import combined, partial_keys, partial_stats
from .chunks import gradient_names, unpack


def sliced(
    *operands,
    mode,
    needs,
    has_bias,
    linear,
    options,
    entropy,
    slices,
    row=WHOLE,
    data_axes=(),
):
    """ "loss": the rows' statistics (``row_names``), then the kept slices' logits;
    "backward": the gradients in ``needs`` from the per-row statistics and coefficients,
    dh in h's dtype, dW in the weight's, db in float32. ``row`` and ``data_axes`` are
    the mesh axes that split the vocabulary and the rows."""
    h, w, bias, labels, kept, per_row = unpack(operands, has_bias, mode, slices)
    lead, d = labels.shape, h.shape[-1]
    h, labels = h.reshape(-1, d), labels.reshape(-1)
    kept = [k.reshape(-1, k.shape[-1]) for k in kept]
    per_row = [p.reshape(-1) for p in per_row]
    t, vocab = h.shape[0], linear.vocab(w)
    widths = slices.local(row.count)
    starts = [sum(widths[:j]) for j in range(len(widths))]
    here = labels - row.start(vocab)
    # the uniform slices but the last max(kept, 1) go in a loop, the others one by one
    looped = len(widths) - max(slices.kept, 1)
    first_kept = len(widths) - slices.kept

    def weight(start, width):
        """The slice's weight and bias, padded as the GEMMs take them."""
        wj = lax.dynamic_slice_in_dim(w, start, width, axis=linear.vocab_axis)
        bj = None if bias is None else lax.dynamic_slice_in_dim(bias, start, width)
        return linear.padded(wj, bj)

    def logits(hh, wj, bj, width):
        z = linear.logits(hh, wj, bj)
        return z[:, :width] if z.shape[-1] > width else z

    if mode == "loss":
        stat = compute_dtype(linear.preferred_element_type)
        keys = partial_keys(options, entropy)
        parts = {k: varying_like(h, jnp.zeros((len(widths), t), stat)) for k in keys}

        def store(parts, j, values):
            return {k: lax.dynamic_update_index_in_dim(parts[k], values[k], j, 0) for k in keys}

        def step(j, parts):
            start = j * widths[0]
            z = logits(h, *weight(start, widths[0]), widths[0])
            return store(parts, j, partial_stats(z, here - start, options, entropy))

        parts = lax.fori_loop(0, looped, step, parts)
        # the slices after the loop start when it ends, so that the loop's logits and
        # the kept ones are never held together
        late, parts = lax.optimization_barrier((h, parts))
        made = []
        for j in range(looped, len(widths)):
            z = logits(late, *weight(starts[j], widths[j]), widths[j])
            parts = store(parts, j, partial_stats(z, here - starts[j], options, entropy))
            made += [z] * (j >= first_kept)
        outs = combined(
            parts,
            labels,
            vocab * row.count,
            options,
            entropy,
            lambda v: _over(row.axes, jax.lax.pmax, jnp.max(v, axis=0)),
            lambda v: _over(row.axes, jax.lax.psum, jnp.sum(v, axis=0)),
        )
        lead_outs = [v.astype(stat).reshape(lead) for v in outs]
        return lead_outs + [z.reshape(*lead, z.shape[-1]) for z in made]

    # where slices are made again, the weight behind a barrier with the cotangents: XLA,
    # which removes a loop that runs once, cannot then take a slice made again here for
    # the forward pass's (whose logits it would hold from one pass to the other), nor
    # hold the forward's slices of the weight
    # (docs/decisions/028-per-row-losses-over-vocabulary-slices.md)
    if first_kept:
        w, _ = lax.optimization_barrier((w, per_row))
    grads = gradient_names(mode, needs)
    carry = {"dh": jnp.zeros((t, d), jnp.float32), "dw": jnp.zeros(w.shape, w.dtype)}
    carry |= {"db": jnp.zeros((vocab,), jnp.float32)}
    carry = {k: varying_like(h, v) for k, v in carry.items() if k in grads}
    # dW's slices are summed over the devices that split the rows in float32
    dw_gemm = jnp.float32 if data_axes else w.dtype

    def add(carry, z, start, width, wj):
        """The slice's dlogits over its logits ``z``, and its share of the gradients;
        ``wj`` is its weight as the GEMMs take it."""
        (dz,) = backward.bind(
            z, here - start, *per_row, options=options, entropy=entropy, inplace=True
        )
        dz = dz.astype(h.dtype)
        padding = wj.shape[linear.vocab_axis] - width
        dz = jnp.pad(dz, ((0, 0), (0, padding))) if padding else dz
        carry = dict(carry)
        if "dh" in carry:
            carry["dh"] = carry["dh"] + linear.dh(dz, wj)
        if "dw" in carry:
            dw = linear.dw(h, dz, dw_gemm)
            dw = lax.slice_in_dim(dw, 0, width, axis=linear.vocab_axis) if padding else dw
            dw = jax.lax.psum(dw, data_axes).astype(w.dtype) if data_axes else dw
            update = lax.dynamic_update_slice_in_dim
            carry["dw"] = update(carry["dw"], dw, start, axis=linear.vocab_axis)
        if "db" in carry:
            db = jnp.sum(dz[:, :width] if padding else dz, axis=0, dtype=jnp.float32)
            db = jax.lax.psum(db, data_axes) if data_axes else db
            carry["db"] = lax.dynamic_update_slice_in_dim(carry["db"], db, start, 0)
        return carry

    def made_again(carry, start, width):
        wj, bj = weight(start, width)
        return add(carry, logits(h, wj, bj, width), start, width, wj)

    for j, z in zip(range(first_kept, len(widths)), kept, strict=True):
        carry = add(carry, z, starts[j], widths[j], weight(starts[j], widths[j])[0])
    carry = lax.fori_loop(0, looped, lambda j, c: made_again(c, j * widths[0], widths[0]), carry)
    for j in range(looped, first_kept):
        carry = made_again(carry, starts[j], widths[j])
    if "dh" in carry:
        dh = jax.lax.psum(carry["dh"], row.axes) if row.axes else carry["dh"]
        carry["dh"] = dh.astype(h.dtype).reshape(*lead, d)
    return [carry[k] for k in grads]


def _over(axes, collective, v):
    return collective(v, axes) if axes else v
