"""Row-wise kernels as JAX primitives, lowered per platform.

Each kernel is a primitive whose first operand is an ``(..., n)`` array reduced over its
last axis. On a CUDA device whose arch has kernels it lowers to one launch of a cubin,
except at the shapes where the reference measured faster (``REFERENCE_FASTER``);
everywhere else (CPU, TPU, other GPUs, dtypes or sizes the kernels do not cover) it
lowers to an XLA reference with the same semantics. The choice is made when the
computation is lowered for a platform, so one jitted function runs on CPU and GPU devices
in the same process. By default operands and results are all of the first operand's
shape, and batching moves the batch axis into the leading rows.

Differentiation: an op gives its primitive a JVP rule built from kernels, and a linear
primitive a transpose rule, so ``jax.grad`` and ``jax.jvp`` run kernels in both
directions. By default a primitive differentiates its reference, which keeps every
derivative order (``jax.hessian``, forward-over-reverse) available through XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir

from . import _ffi
from ._cache import get_kernel
from ._configs import KernelConfig
from ._jax_private import new_primitive
from ._lowering import options
from ._partition import ROWS, partitioned
from ._tiling import STREAM_MIN_ROWS, TilingFamily, choose_tiling

# compute capability -> the arch the kernels are compiled for
KERNEL_ARCHS = {"9.0": "sm_90a"}
KERNEL_DTYPES = ("float32", "bfloat16", "float16")
MAX_ROWS = 2**31 - 1


# SMs of the devices lowered for when none is present (an H100 SXM or H200 has 132)
DEFAULT_SMS = 132
# The register file and limits per SM, for persistent grids (sm_90).
_SM_REGISTERS, _SM_THREADS, _SM_CTAS, _SM_SMEM = 65536, 2048, 32, 228 * 1024


@dataclasses.dataclass(frozen=True)
class Target:
    """What kernels are lowered for: the arch, the number of SMs per device and the CUDA
    ordinal of one of the devices (None when lowering where no CUDA device is present)."""

    arch: str
    sms: int = DEFAULT_SMS
    device: int | None = None


def kernel_target(ctx: mlir.LoweringRuleContext) -> Target | None:
    """The kernel target of the CUDA devices being lowered for, or None if they have none.

    Lowering for CUDA where no CUDA device is present (``jax.export`` for a GPU from a
    CPU host) uses the arch in ``$QUACK_JAX_CUDA_ARCH`` (``sm_90a``), if set.
    """
    try:
        backend = ctx.module_context.get_backend(optional=True)
    except RuntimeError:
        backend = None
    if backend is None:
        arch = os.environ.get("QUACK_JAX_CUDA_ARCH")
        return Target(arch) if arch in KERNEL_ARCHS.values() else None
    devices = backend.local_devices()
    archs = {kernel_arch(d) for d in devices}
    arch = archs.pop() if len(archs) == 1 else None
    if arch is None:
        return None
    sms = min(getattr(d, "core_count", DEFAULT_SMS) for d in devices)
    return Target(arch, sms, devices[0].local_hardware_id)


def compute_dtype(dtype):
    """float32 math for the 16-bit dtypes, as the kernels do; float64 stays float64."""
    return jnp.promote_types(dtype, jnp.float32)


def kernel_arch(device) -> str | None:
    """The arch quack_jax's kernels are compiled for on ``device``, or None if it has
    none (not a CUDA GPU of a supported compute capability)."""
    if device.platform != "gpu":
        return None
    return KERNEL_ARCHS.get(getattr(device, "compute_capability", None))


def rows(aval) -> int:
    return math.prod(aval.shape[:-1])


# Kernel choices that depend on the number of rows (the streamed tilings from
# STREAM_MIN_ROWS rows; the norm backward that sums its own weight-gradient partials over
# few row blocks) take their count through ``counted``, each naming a count of its own
# for each of ``_lowering.ROW_REGIMES``: a build lowers a function once in each
# (``build.lower_for_cuda``'s ``any_rows``), so that it holds the kernels that any number
# of rows takes (docs/decisions/007-row-regimes.md).
def counted(count: int, *, few: int, many: int) -> int:
    """``count`` (of rows, or of row blocks), or under a row regime (``_lowering``'s
    ``regime``) the count that the caller names for it: ``few`` or ``many``."""
    return {None: count, "few": few, "many": many}[options().regime]


def row_tiling(aval, family: TilingFamily, vec_itemsize=None, live=None, staged_bytes=None):
    """The tiling of ``family`` for rows like ``aval``'s (see ``choose_tiling``), or None
    where the kernels do not apply (dtype, empty or too many rows, rows too long)."""
    n, m = aval.shape[-1], rows(aval)
    if aval.dtype.name in KERNEL_DTYPES and n > 0 and 0 < m <= MAX_ROWS:
        itemsize, regime_rows = aval.dtype.itemsize, counted(m, few=1, many=STREAM_MIN_ROWS)
        return choose_tiling(
            family, n, itemsize, vec_itemsize, live, staged_bytes, regime_rows, aval.dtype.name
        )
    return None


def kernel_call(
    target: Target, config: KernelConfig, aval, tiling, results, cluster=True, aliases=None
):
    """A function of the operands that launches the kernel of ``config`` once per row
    block of rows like ``aval``'s, with scalars ``(m, *config.scalars())``; without
    ``cluster`` the CTAs that share a row are launched as plain CTAs (kernels that do not
    reduce across them). ``aliases``: results written over operands (see ``_ffi.call``)."""
    m = rows(aval)
    kernel = get_kernel(config, aval.dtype.name, tiling, target.arch)
    dims = tiling.cluster if cluster else (1, 1, 1)
    scalars = (m, *config.scalars())
    return _ffi.call(kernel, tiling.grid(m), tiling.block, dims, scalars, results, aliases)


def resident_clusters(kernel, tiling, target: Target) -> int:
    """How many clusters of ``kernel`` (CTAs, if it has no cluster) the GPU holds at once:
    one wave of a persistent grid. The driver's count for the device lowered for; where
    none is present, an estimate from the SM count, which overcounts large clusters (a
    cluster must fit in one GPC), so that a second, short wave runs after the first:
    docs/decisions/013-persistent-grids-by-driver-occupancy.md."""
    if target.device is not None:
        key = (kernel, tiling.num_threads, tiling.cluster_n, target.device)
        return max(_active_clusters(*key), 1)
    warps = tiling.num_threads // 32
    per_warp = -(-max(kernel.registers, 1) * 32 // 256) * 256
    per_sm = min(
        _SM_CTAS,
        _SM_REGISTERS // (per_warp * warps),
        _SM_THREADS // tiling.num_threads,
        _SM_SMEM // (kernel.smem_bytes + 1024),
    )
    return max(target.sms * max(per_sm, 1) // tiling.cluster_n, 1)


_active_clusters = functools.cache(_ffi.max_active_clusters)


# Where XLA's fused formulation (the primitive's reference) measured faster than the
# kernel, by primitive name: each family declares its primitives' rules
# (``RowwisePrimitive``'s ``prefers_reference``), predicates of (rows, row length,
# itemsize, **the primitive's params); docs/decisions/004-small-shape-xla-rules.md.
REFERENCE_FASTER: dict[str, Callable[..., bool]] = {}


def use_kernel(name: str, aval, params: dict) -> bool:
    """Whether the primitive ``name`` with ``params`` launches its kernel for rows like
    ``aval``'s, on a target that has kernels (see ``_lowering``'s ``path``)."""
    path = options().path
    if path != "auto":
        return path == "kernel"
    faster = REFERENCE_FASTER.get(name)
    return not (faster and faster(rows(aval), aval.shape[-1], aval.dtype.itemsize, **params))


def grid_is_one_wave(one_wave: bool) -> bool:
    """Whether a persistent kernel whose family's rule gives ``one_wave`` is launched on
    one wave: the rule, unless ``_lowering``'s ``one_wave`` forces the grid."""
    forced = options().one_wave
    return one_wave if forced is None else forced


def persistent_call(
    target: Target, config: KernelConfig, aval, tiling, results, one_wave=True, one_cluster=1
):
    """Like ``kernel_call`` for a kernel that loops over row blocks: launched on one wave of
    clusters (``resident_clusters``; at most one per row block), or with ``one_wave``
    false on one CTA per row block (see ``grid_is_one_wave``), or with ``one_cluster`` > 1
    (tilings without a cluster of their own) as one cluster of that many CTAs along x;
    ``results(ctas)`` gives the result structs, which may depend on the grid (per-CTA
    partials)."""
    m = rows(aval)
    kernel = get_kernel(config, aval.dtype.name, tiling, target.arch)
    ctas, cluster = -(-m // tiling.rows_per_cta), tiling.cluster
    if one_cluster > 1:
        ctas, cluster = one_cluster, (one_cluster, 1, 1)
    elif grid_is_one_wave(one_wave):
        ctas = min(ctas, resident_clusters(kernel, tiling, target))
    grid = (ctas, tiling.cluster_n, 1)
    scalars = (m, *config.scalars())
    return _ffi.call(kernel, grid, tiling.block, cluster, scalars, results(ctas))


class RowwisePrimitive:
    """``reference(*operands, **params)`` gives the results. ``kernel(target, avals_in,
    avals_out, **params)`` gives a function of the operands that computes them with
    kernels for ``target`` (see ``kernel_call``), or None to use the reference.
    ``roles(**params)`` gives the operands' and results' roles for partitioning (see
    ``_partition``; default: all of the first operand's shape). ``prefers_reference(m,
    n, itemsize, **params)`` is the family's rule for where the default lowering takes
    the reference instead of the kernel (see ``REFERENCE_FASTER``). ``split(row, **params)``
    gives the function of one device's slice of n (see ``_partition``); by default the
    reference, which takes the ``Row`` to reduce over as ``row``."""

    def __init__(
        self,
        name: str,
        *,
        kernel: Callable,
        reference: Callable[..., tuple],
        num_outputs: int = 1,
        abstract: Callable | None = None,
        batch: Callable | None = None,
        jvp: Callable | None = None,
        transpose: Callable | None = None,
        roles: Callable | None = None,
        split: Callable | None = None,
        prefers_reference: Callable[..., bool] | None = None,
    ):
        self.kernel = kernel
        self.reference = reference
        self.num_outputs = num_outputs
        p = self.primitive = new_primitive(name)
        if prefers_reference:
            REFERENCE_FASTER[name] = prefers_reference
        p.def_abstract_eval(abstract or self._abstract_eval)
        batching.primitive_batchers[p] = batch or self._batch
        ad.primitive_jvps[p] = jvp or self._reference_jvp
        if transpose:
            ad.primitive_transposes[p] = transpose
        self.roles, self.split = roles, split or self._split_reference
        mlir.register_lowering(p, functools.partial(self._lower, cuda=False))
        mlir.register_lowering(p, functools.partial(self._lower, cuda=True), platform="cuda")

    def bind(self, *operands, **params):
        return self.primitive.bind(*operands, **params)

    def _reference_outputs(self, *operands, **params):
        return list(self.reference(*operands, **params))

    def _split_reference(self, row, **params):
        return functools.partial(self._reference_outputs, row=row, **params)

    def _reference_jvp(self, primals, tangents, **params):
        tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
        return jax.jvp(lambda *a: self._reference_outputs(*a, **params), tuple(primals), tangents)

    def _abstract_eval(self, *avals, **params):
        return [avals[0].update(weak_type=False)] * self.num_outputs

    def _batch(self, operands, dims, **params):
        size = next(x.shape[d] for x, d in zip(operands, dims, strict=True) if d is not None)
        moved = [
            jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
            for x, d in zip(operands, dims, strict=True)
        ]
        outs = self.bind(*moved, **params)
        return outs, [0] * len(outs)

    def _lower(self, ctx, *operands, cuda: bool, **params):
        """Kernels where the CUDA target has them, else the reference; partitioned along
        the rows under a sharded jit (see ``_partition``)."""
        target = kernel_target(ctx) if cuda else None
        reference = functools.partial(self._reference_outputs, **params)

        def make(avals_in, avals_out):
            kernel = target and use_kernel(self.primitive.name, avals_in[0], params)
            fn = kernel and self.kernel(target, avals_in, avals_out, **params)
            return fn or reference

        n_in, n_out = len(ctx.avals_in), len(ctx.avals_out)
        roles_in, roles_out = (
            self.roles(**params) if self.roles else ((ROWS,) * n_in, (ROWS,) * n_out)
        )
        split = functools.partial(self.split, **params)
        # over several devices, the partitioned call's global body is never run
        devices = getattr(ctx.module_context.axis_context, "num_devices", 1)
        body = reference if devices > 1 else None
        fn = partitioned(make, ctx.avals_in, ctx.avals_out, roles_in, roles_out, split, body)
        return mlir.lower_fun(lambda *ops: list(fn(*ops)), multiple_results=True)(ctx, *operands)
