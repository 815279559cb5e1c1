"""How XLA partitions a row-wise op under a sharded ``jit``: along the rows, and along
each row by combining per-row partial statistics.

Every operand and result of a row-wise primitive has one of three roles, relative to the
first operand's shape ``(*lead, n)``: ``ROWS`` (that shape), ``STAT`` (one value per row,
shape ``lead``) or ``VECTOR`` (shape ``(n,)``: weights as inputs, sums over all rows as
results). The op is wrapped in ``jax.experimental.custom_partitioning`` with a Shardy
sharding rule: where the leading dims are sharded, each device runs the op (kernel or
XLA reference) on its own rows, ``VECTOR`` inputs are replicated and ``VECTOR``
results are summed over the devices that split the rows (``psum`` of one length-n
vector). No collective touches the activations.

An op may also take n split across devices (``split``): each device then holds a slice
of every row (and of each ``VECTOR``), and ``split(row)`` gives the per-device function,
which reduces over the row with ``row``'s methods (a ``Row`` over the mesh axes that
split n): per-row partial statistics combined with ``pmax``/``psum``, never a gather.
Where the mesh does not split n evenly, n is gathered first. The measurements behind
this design: docs/decisions/018-sharding-by-operand-roles.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

ROWS, STAT, VECTOR = "rows", "stat", "vector"
NO_MESH = AbstractMesh((), ())


@dataclasses.dataclass(frozen=True)
class Row:
    """Reductions over the last axis (keeping it, as size 1) of rows split over the mesh
    ``axes`` into ``count`` slices, one per device; the default is a whole row."""

    axes: tuple = ()
    count: int = 1

    def sum(self, v):
        total = jnp.sum(v, axis=-1, keepdims=True)
        return jax.lax.psum(total, self.axes) if self.axes else total

    def max(self, v):
        top = jnp.max(v, axis=-1, keepdims=True, initial=-jnp.inf)
        return jax.lax.pmax(top, self.axes) if self.axes else top

    def mean(self, v):
        return self.sum(v) / (v.shape[-1] * self.count)

    def start(self, width: int):
        """The first column of this device's slice, of ``width`` columns."""
        return jax.lax.axis_index(self.axes) * width if self.axes else 0


WHOLE = Row()


def role_aval(x, role: str, dtype=None):
    """The abstract value of a ``role`` value for first operand ``x``: its shape, dtype
    (default x's) and, under explicit sharding, the sharding that follows from x's."""
    spec = (tuple(x.sharding.spec) + (None,) * x.ndim)[: x.ndim]
    shape, spec = {
        ROWS: (x.shape, spec),
        STAT: (x.shape[:-1], spec[:-1]),
        VECTOR: (x.shape[-1:], spec[-1:]),
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


def names(axes) -> tuple:
    """The mesh axis names of one PartitionSpec entry."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def count(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in names(axes))


def dims_spec(mesh, sharding, aval) -> tuple:
    """The mesh axes of each dim of ``aval`` (the first operand) in ``sharding``; None for
    dims that are not sharded or that the mesh does not split evenly."""
    spec = tuple(getattr(sharding, "spec", ())) + (None,) * aval.ndim
    return tuple(
        axes if names(axes) and size % count(mesh, axes) == 0 else None
        for size, axes in zip(aval.shape, spec, strict=False)
    )


def _spec(role: str, lead: tuple, cols) -> PartitionSpec:
    return {ROWS: PartitionSpec(*lead, cols), STAT: PartitionSpec(*lead)}.get(
        role, PartitionSpec(cols)
    )


def _local(aval, role: str, lead: tuple, mesh):
    """``aval``'s share on one device, with the rows split over ``lead`` and n whole."""
    if role == VECTOR:
        return aval
    dims = (*lead, None) if role == ROWS else lead
    shape = tuple(size // count(mesh, axes) for size, axes in zip(aval.shape, dims, strict=True))
    return jax.ShapeDtypeStruct(shape, aval.dtype)


def custom_partitioned(
    whole, avals_in, avals_out, layout, local, rule, reduction_factors=(), factor_sizes=None
):
    """``whole`` (a function of the operands) as a ``custom_partitioning`` op that XLA
    partitions by the Shardy sharding ``rule``. ``layout(mesh, arg_shapes)`` gives the
    operands' and results' shardings and a plan; ``local(mesh, plan)`` the function each
    device runs on its shares. ``reduction_factors``: the rule's factors that the
    results are reduced over (by ``local``'s collectives); ``factor_sizes``: the sizes of
    factors that appear only in compound ones."""

    @custom_partitioning
    def op(*operands):
        return tuple(whole(*operands))

    def infer(mesh, arg_shapes, result_shape):
        return tuple(layout(mesh, arg_shapes)[1])

    def partition(mesh, arg_shapes, result_shape):
        arg_shardings, out_shardings, plan = layout(mesh, arg_shapes)
        fn = local(mesh, plan)

        def lower(*operands):
            # traced as XLA compiles, maybe under the caller's mesh, whose explicit axes
            # would give the values made here (constants) sharding constraints that reach
            # the backend: each device's function has no mesh
            with jax.sharding.use_abstract_mesh(NO_MESH):
                return tuple(fn(*operands))

        return mesh, lower, tuple(out_shardings), tuple(arg_shardings)

    op.def_partition(
        partition,
        infer_sharding_from_operands=infer,
        sharding_rule=rule,
        reduction_factors=tuple(reduction_factors),
        **(factor_sizes or {}),
    )
    return in_auto_axes(op, avals_in, avals_out)


def partitioned(
    make: Callable,
    avals_in,
    avals_out,
    roles_in: Sequence[str],
    roles_out: Sequence[str],
    split: Callable,
    body: Callable | None = None,
):
    """A function of the operands that computes ``make(avals_in, avals_out)(*operands)``
    and that XLA partitions along the rows (``make`` is called again with each device's
    share of the shapes) and along n (``split``; see the module docstring). ``body``, if
    given, is the function of the whole operands in the partitioned call instead: under a
    jit over several devices XLA runs the per-device functions, and the body only gives
    the results' types, so it need not launch kernels for the global shapes."""
    lead_rank = len(avals_in[0].shape) - 1
    if lead_rank == 0:  # a single row: nothing to split
        return make(avals_in, avals_out)

    def layout(mesh, arg_shapes):
        *lead, cols = dims_spec(mesh, arg_shapes[0].sharding, arg_shapes[0])
        return (
            [NamedSharding(mesh, _spec(r, lead, cols)) for r in roles_in],
            [NamedSharding(mesh, _spec(r, lead, cols)) for r in roles_out],
            (tuple(lead), cols),
        )

    def local(mesh, plan):
        lead, cols = plan
        if cols is not None:
            fn = split(Row(names(cols), count(mesh, cols)))
        else:
            fn = make(
                [_local(a, r, lead, mesh) for a, r in zip(avals_in, roles_in, strict=True)],
                [_local(a, r, lead, mesh) for a, r in zip(avals_out, roles_out, strict=True)],
            )
        axes = tuple(name for a in lead for name in names(a))

        def summed(*operands):
            outs = list(fn(*operands))
            if axes:
                outs = [
                    jax.lax.psum(o, axes) if r == VECTOR else o
                    for o, r in zip(outs, roles_out, strict=True)
                ]
            return outs

        return summed

    # where no result has n, the results are reduced over it (by ``split``'s collectives)
    reduces = all(r != ROWS for r in roles_out)
    rule = sharding_rule(roles_in, roles_out, lead_rank)
    whole = body or make(avals_in, avals_out)
    return custom_partitioned(
        whole, avals_in, avals_out, layout, local, rule, ("n",) if reduces else ()
    )


def in_auto_axes(op, avals_in, avals_out):
    """``op`` (a ``custom_partitioning`` function) as it runs under explicit sharding:
    its rule decides the shardings, and the results keep the types' shardings."""
    explicit = avals_in[0].sharding.mesh.explicit_axes
    if explicit:
        return jax.sharding.auto_axes(
            op, axes=explicit, out_sharding=tuple(a.sharding for a in avals_out)
        )
    return op


def _varying_axes(a) -> frozenset:
    """The manual mesh axes (inside ``shard_map``) that ``a`` varies over."""
    aval = jax.typeof(a)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    return frozenset(getattr(getattr(aval, "manual_axis_type", None), "varying", ()))


def varying_like(x, v):
    """``v`` marked as varying over the manual mesh axes that ``x`` varies over (inside
    ``shard_map``), so that its gradient, computed per shard, is summed over them."""
    if v is None:
        return v
    axes = tuple(sorted(_varying_axes(x) - _varying_axes(v)))
    return jax.lax.pcast(v, axes, to="varying") if axes else v
