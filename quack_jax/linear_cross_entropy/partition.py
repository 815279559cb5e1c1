"""How XLA partitions linear + cross-entropy under a sharded ``jit``: each device runs
the chunks (or vocabulary slices) of its own rows, and dW (and the bias gradient) is
summed over the devices that split the rows (one ``psum`` at the end, or one per
slice). With the weight's vocabulary axis split (a tensor-parallel LM head), each device
takes its share of every slice, the per-row statistics are combined across the devices
as ``cross_entropy`` does, and dh is summed over them
(docs/decisions/018-sharding-by-operand-roles.md)."""

from __future__ import annotations

import functools
import re

from jax.sharding import NamedSharding, PartitionSpec

from .._partition import WHOLE, Row, count, custom_partitioned, dims_spec, names
from .chunks import chunked, gradient_names, result_names, unpack
from .slices import sliced


def _vocab_factors(slices):
    """(the vocabulary's factor, each kept slice's): v for both where one slice holds the
    vocabulary; where the slices are equal parts of it, the vocabulary as the compound
    (w s) of a slice's width and their count, which a split of the vocabulary shards
    along w, as it does each kept slice; v and k0.. for unequal slices (where equal
    parts in their count would not be a multiple of 8 wide), whose kept logits XLA
    gathers where it splits the vocabulary itself
    (docs/decisions/028-per-row-losses-over-vocabulary-slices.md)."""
    kept = slices.kept if slices else 0
    if not kept:
        return "v", ()
    if len(slices.widths) == 1:
        return "v", ("v",)
    if len(set(slices.widths)) == 1:
        return "(w s)", ("w",) * kept
    return "v", tuple(f"k{j}" for j in range(kept))


def _factors(mode, needs, has_bias, entropy, slices, transpose, lead_rank, n_per_row):
    """The Shardy factors of each operand and result: b0.. for the rows, d, and the
    vocabulary's and the kept slices' (``_vocab_factors``)."""
    rows = tuple(f"b{i}" for i in range(lead_rank))
    v, slice_factors = _vocab_factors(slices)
    weight = (v, "d") if transpose else ("d", v)
    kept = {f"kept{j}": (*rows, f) for j, f in enumerate(slice_factors)}
    ins = [(*rows, "d"), weight] + [(v,)] * has_bias + [rows]
    ins += list(kept.values()) * (mode == "backward") + [rows] * n_per_row
    made = {"dh": (*rows, "d"), "dw": weight, "db": (v,)} | kept
    results = result_names(mode, entropy, slices) + gradient_names(mode, needs)
    return ins, [made.get(k, rows) for k in results]


def _schedule(params):
    """The per-device function: over vocabulary slices, or in chunks of rows."""
    params = dict(params)
    slices = params.pop("slices")
    if slices:
        del params["token_loss"]
        return functools.partial(sliced, **params, slices=slices)
    return functools.partial(chunked, **params)


def partitioned(params, avals_in, avals_out):
    """A function of the operands that computes the op and that XLA partitions along the
    rows of h and along the weight's vocabulary axis."""
    whole = _schedule(params)
    lead_rank = avals_in[0].ndim - 1
    if lead_rank == 0:  # a single row: nothing to split
        return whole
    transpose = params["linear"].transpose_weight
    mode, has_bias, slices = params["mode"], params["has_bias"], params["slices"]
    *_, per_row = unpack(avals_in, has_bias, mode, slices)
    flags = (mode, params["needs"], has_bias, params["entropy"], slices)
    ins, outs = _factors(*flags, transpose, lead_rank, len(per_row))

    def layout(mesh, arg_shapes):
        *lead, _ = dims_spec(mesh, arg_shapes[0].sharding, arg_shapes[0])
        vocab = dims_spec(mesh, arg_shapes[1].sharding, arg_shapes[1])[0 if transpose else 1]
        taken = {a for axes in lead for a in names(axes)}
        if set(names(vocab)) & taken:  # a mesh axis splits the rows or the vocabulary
            vocab = None
        if vocab and slices and not slices.divides(count(mesh, vocab)):
            vocab = None  # each device must take an even share of every slice
        axes = {f"b{i}": a for i, a in enumerate(lead)} | {"d": None}
        axes |= dict.fromkeys(("v", "(w s)", *_vocab_factors(slices)[1]), vocab)

        def sharding(factors):
            return NamedSharding(mesh, PartitionSpec(*(axes[f] for f in factors)))

        return [sharding(f) for f in ins], [sharding(f) for f in outs], (lead, vocab)

    def local(mesh, plan):
        lead, vocab = plan
        row = Row(names(vocab), count(mesh, vocab)) if vocab else WHOLE
        data = tuple(a for axes in lead for a in names(axes))
        return functools.partial(_schedule(params), row=row, data_axes=data)

    rule = " -> ".join(", ".join(" ".join(f) for f in side) for side in (ins, outs))
    produced = set(re.findall(r"\w+", " ".join(sum(outs, ()))))
    reduced = [
        f for f in dict.fromkeys(re.findall(r"\w+", " ".join(sum(ins, ())))) if f not in produced
    ]
    sizes = {"s": len(slices.widths)} if "(w s)" in rule else None
    return custom_partitioned(whole, avals_in, avals_out, layout, local, rule, reduced, sizes)
