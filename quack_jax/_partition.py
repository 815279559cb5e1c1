"""How XLA partitions a row-wise op under a sharded ``jit``: along the rows, and along
the row only for ops that combine per-row partial statistics.

Every operand and result of a row-wise primitive has one of three roles, relative to the
first operand's shape ``(*lead, n)``: ``ROWS`` (that shape), ``STAT`` (one value per row,
shape ``lead``) or ``VECTOR`` (shape ``(n,)``: weights as inputs, sums over all rows as
results). The op is wrapped in ``jax.experimental.custom_partitioning`` with a Shardy
sharding rule that keeps n whole (see below for the exception): where the leading dims
are sharded, each device runs
the op (kernel or XLA reference) on its own rows, ``VECTOR`` inputs are replicated and
``VECTOR`` results are summed over the devices that split the rows (``psum`` of one
length-n vector). No collective touches the activations.

An op may also take n split across devices (``split``: cross-entropy over a sharded
vocabulary): each device then holds a slice of every row, and ``split(axes, count)``
gives the per-device function, which combines per-row partial statistics over the mesh
``axes`` that split n (``count`` devices). Other ops keep n whole: a sharded n is gathered
first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

ROWS, STAT, VECTOR = "rows", "stat", "vector"


def role_aval(x, role: str, dtype=None):
    """The abstract value of a ``role`` value for first operand ``x``: its shape, dtype
    (default x's) and, under explicit sharding, the sharding that follows from x's."""
    spec = (tuple(x.sharding.spec) + (None,) * x.ndim)[: x.ndim]
    shape, spec = {
        ROWS: (x.shape, spec),
        STAT: (x.shape[:-1], spec[:-1]),
        VECTOR: (x.shape[-1:], (None,)),
    }[role]
    return x.update(
        shape=shape,
        dtype=x.dtype if dtype is None else dtype,
        weak_type=False,
        sharding=x.sharding.update(spec=spec),
    )


def _factors(role: str, lead: int) -> str:
    rows = " ".join(f"b{i}" for i in range(lead))
    return {ROWS: f"{rows} n", STAT: rows, VECTOR: "n"}[role].strip()


def sharding_rule(roles_in: Sequence[str], roles_out: Sequence[str], lead: int) -> str:
    """The Shardy rule: leading factors b0.. shared by ROWS and STAT values, n by ROWS and
    VECTOR values (``lead`` >= 1)."""

    def side(roles):
        return ", ".join(_factors(r, lead) for r in roles)

    return f"{side(roles_in)} -> {side(roles_out)}"


def _names(axes) -> tuple:
    """The mesh axis names of one PartitionSpec entry."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _count(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in _names(axes))


def _dims_spec(mesh, sharding, aval) -> tuple:
    """The mesh axes of each dim of ``aval`` (the first operand) in ``sharding``; None for
    dims that are not sharded or that the mesh does not split evenly."""
    spec = tuple(getattr(sharding, "spec", ())) + (None,) * aval.ndim
    return tuple(
        axes if _names(axes) and size % _count(mesh, axes) == 0 else None
        for size, axes in zip(aval.shape, spec, strict=False)
    )


def _spec(role: str, lead: tuple, cols) -> PartitionSpec:
    return {ROWS: PartitionSpec(*lead, cols), STAT: PartitionSpec(*lead)}.get(
        role, PartitionSpec(None)
    )


def _local(aval, role: str, lead: tuple, cols, mesh):
    if role == VECTOR:
        return aval
    dims = (*lead, cols) if role == ROWS else lead
    shape = tuple(size // _count(mesh, axes) for size, axes in zip(aval.shape, dims, strict=True))
    return jax.ShapeDtypeStruct(shape, aval.dtype)


def partitioned(
    make: Callable,
    avals_in,
    avals_out,
    roles_in: Sequence[str],
    roles_out: Sequence[str],
    split: Callable | None = None,
):
    """A function of the operands that computes ``make(avals_in, avals_out)(*operands)``
    and that XLA partitions along the rows, and with ``split`` along n too (see the module
    docstring). ``make`` is called again with each device's share of the shapes."""
    lead_rank = len(avals_in[0].shape) - 1
    if lead_rank == 0:  # a single row: nothing to split
        return make(avals_in, avals_out)

    @custom_partitioning
    def op(*operands):
        return tuple(make(avals_in, avals_out)(*operands))

    def shardings(mesh, arg_shapes):
        *lead, cols = _dims_spec(mesh, arg_shapes[0].sharding, arg_shapes[0])
        cols = cols if split else None
        return (
            tuple(lead),
            cols,
            [NamedSharding(mesh, _spec(r, lead, cols)) for r in roles_in],
            [NamedSharding(mesh, _spec(r, lead, cols)) for r in roles_out],
        )

    def infer(mesh, arg_shapes, result_shape):
        return tuple(shardings(mesh, arg_shapes)[3])

    def partition(mesh, arg_shapes, result_shape):
        lead, cols, arg_shardings, out_shardings = shardings(mesh, arg_shapes)
        if cols is not None:
            local = split(cols, _count(mesh, cols))
        else:
            local = make(
                [_local(a, r, lead, None, mesh) for a, r in zip(avals_in, roles_in, strict=True)],
                [_local(a, r, lead, None, mesh) for a, r in zip(avals_out, roles_out, strict=True)],
            )
        axes = tuple(name for a in lead for name in _names(a))

        def lower(*operands):
            outs = list(local(*operands))
            if axes:
                outs = [
                    jax.lax.psum(o, axes) if r == VECTOR else o
                    for o, r in zip(outs, roles_out, strict=True)
                ]
            return tuple(outs)

        return mesh, lower, tuple(out_shardings), tuple(arg_shardings)

    if split:  # n may stay split; where no result has it, they are reduced over it
        reduces = all(r != ROWS for r in roles_out)
        factors = {"reduction_factors": ("n",)} if reduces else {}
    else:
        factors = {"need_replication_factors": ("n",)}
    op.def_partition(
        partition,
        infer_sharding_from_operands=infer,
        sharding_rule=sharding_rule(roles_in, roles_out, lead_rank),
        **factors,
    )
    return op
