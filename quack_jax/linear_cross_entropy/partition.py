"""How XLA partitions linear + cross-entropy under a sharded ``jit``: each device runs
the chunks of its own rows, and dW (and the bias gradient) is summed over the devices
that split the rows, at the end (one ``psum``). With the weight's vocabulary axis split
(a tensor-parallel LM head), each chunk combines its per-row statistics across the
devices as ``cross_entropy`` does, and its dh is summed over them
(docs/decisions/018-sharding-by-operand-roles.md)."""

from __future__ import annotations

import functools

from jax.sharding import NamedSharding, PartitionSpec

from .._partition import WHOLE, Row, count, custom_partitioned, dims_spec, names
from .chunks import chunked, gradient_names, result_names, unpack


def _factors(mode, needs, has_bias, entropy, kept_logits, transpose, lead_rank, n_per_row):
    """The Shardy factors of each operand and result: b0.. for the rows, d, v."""
    rows = tuple(f"b{i}" for i in range(lead_rank))
    weight = ("v", "d") if transpose else ("d", "v")
    logits = [(*rows, "v")] * (mode == "backward" and kept_logits)
    ins = [(*rows, "d"), weight] + [("v",)] * has_bias + [rows] + logits + [rows] * n_per_row
    made = {"dh": (*rows, "d"), "dw": weight, "db": ("v",), "logits": (*rows, "v")}
    results = result_names(mode, entropy, kept_logits) + gradient_names(mode, needs)
    return ins, [made.get(k, rows) for k in results]


def partitioned(params, avals_in, avals_out):
    """A function of the operands that computes the op and that XLA partitions along the
    rows of h and along the weight's vocabulary axis."""
    whole = functools.partial(chunked, **params)
    lead_rank = avals_in[0].ndim - 1
    if lead_rank == 0:  # a single row: nothing to split
        return whole
    transpose = params["linear"].transpose_weight
    mode, has_bias, kept = params["mode"], params["has_bias"], params["kept_logits"]
    *_, per_row = unpack(avals_in, has_bias, mode, kept)
    flags = (mode, params["needs"], has_bias, params["entropy"], kept)
    ins, outs = _factors(*flags, transpose, lead_rank, len(per_row))

    def layout(mesh, arg_shapes):
        *lead, _ = dims_spec(mesh, arg_shapes[0].sharding, arg_shapes[0])
        vocab = dims_spec(mesh, arg_shapes[1].sharding, arg_shapes[1])[0 if transpose else 1]
        taken = {a for axes in lead for a in names(axes)}
        if set(names(vocab)) & taken:  # a mesh axis splits the rows or the vocabulary
            vocab = None
        axes = {f"b{i}": a for i, a in enumerate(lead)} | {"d": None, "v": vocab}

        def sharding(factors):
            return NamedSharding(mesh, PartitionSpec(*(axes[f] for f in factors)))

        return [sharding(f) for f in ins], [sharding(f) for f in outs], (lead, vocab)

    def local(mesh, plan):
        lead, vocab = plan
        row = Row(names(vocab), count(mesh, vocab)) if vocab else WHOLE
        data = tuple(a for axes in lead for a in names(axes))
        return functools.partial(chunked, **params, row=row, data_axes=data)

    rule = " -> ".join(", ".join(" ".join(f) for f in side) for side in (ins, outs))
    produced = {f for factors in outs for f in factors}
    reduced = [f for f in dict.fromkeys(sum(ins, ())) if f not in produced]
    return custom_partitioned(whole, avals_in, avals_out, layout, local, rule, reduced)
