"""What every row-wise kernel shares: the CTA tile, its per-thread partition, and the
reduction of per-warp partials across the CTA and the cluster.

Layout of the work (see ``quack_jax._tiling.RowTiling``): CTA ``(bx, r)`` of cluster rank
``r`` owns rows ``[bx * R, bx * R + R)`` and columns ``[r * C, r * C + C)`` of the row-major
``(M, n)`` tensors. Tiles are addressed from 64-bit offsets, so ``M * n`` may exceed 2**31.

Naming follows CuTe: ``g`` global tile, ``r`` registers, ``s`` shared; ``tXgX`` is this
thread's partition of ``gX``, ``tXcX`` its coordinates, ``tXpX`` its column predicates.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import ClassVar

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import nullptr

from quack_jax._tiling import STAGE_BYTES, RowTiling

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


@dataclasses.dataclass
class CtaView:
    """One thread's share of a CTA's tile: per-tensor partitions (row-major inputs,
    outputs, and length-n vectors broadcast over the rows), the column predicates (None
    when every vector is inside the row), this thread's row and whether it exists,
    whether the thread holds the row's first column, and the (row, column) coordinates
    of its elements within the CTA's tile, whose first column is ``col0``."""

    sources: list
    destinations: list
    vectors: list
    tXpX: cute.Tensor | None
    row: Int32
    in_rows: cutlass.Boolean
    first_col: cutlass.Boolean
    tXcX: cute.Tensor
    col0: Int32


@dataclasses.dataclass
class Reduction:
    """The shared buffer of per-warp partials and the cluster barriers, ``copies`` of each."""

    buf: cute.Tensor | None
    mbar: cute.Pointer | None


class RowKernel:
    """Base of the row-wise kernels: ``words`` float32 values per warp are reduced, with up
    to ``copies`` reductions in flight (each needs its own buffer and cluster barrier).

    A kernel class's ``kernel`` takes its pointers, the row count ``m``, then the run-time
    scalars of its configuration by their names, in order: ``scalars``, its
    configuration's ``KernelConfig.scalar_types()``. ``compile_args`` gives placeholders
    of them all (``scalar_args`` those from ``m`` on), and ``__call__`` launches ``kernel``
    on them."""

    words = 1
    copies = 1
    scalars: ClassVar[dict[str, type]] = {}

    def __init__(self, dtype: type[cutlass.Numeric], tiling: RowTiling):
        self.dtype = dtype
        self.tiling = tiling
        self.even_cols = tiling.cols_per_cta * tiling.cluster_n == tiling.n
        self.needs_buffer = tiling.warps_per_row > 1 or tiling.cluster_n > 1
        self.smem_bytes = tiling.smem_bytes(self.words, self.copies)

    def pointer(self, dtype: type[cutlass.Numeric], row: bool = True):
        """A placeholder pointer for compiling: to rows of this tiling, or to float32 stats."""
        align = self.tiling.vec * dtype.width // 8 if row else 4
        return nullptr(dtype, cute.AddressSpace.gmem, assumed_align=align)

    def scalar_args(self, absent=()) -> tuple:
        """Placeholders for compiling of ``m`` and of each scalar, in order: Int32 for an
        int, Float32 for a float, None for the scalars named in ``absent`` (not passed)."""
        scalars = [
            None if name in absent else Int32(0) if word is int else Float32(0.0)
            for name, word in self.scalars.items()
        ]
        return (Int32(0), *scalars)

    @cute.jit
    def __call__(self, *args):
        """Launch ``kernel`` on ``compile_args``'s arguments, which the stream follows."""
        m = args[-2 - len(self.scalars)]  # the row count, before the scalars
        self.kernel(*args[:-1]).launch(**self.launch_args(m), stream=args[-1])

    def launch_args(self, m):
        t = self.tiling
        return dict(
            grid=[cute.ceil_div(m, t.rows_per_cta), t.cluster_n, 1],
            block=list(t.block),
            cluster=list(t.cluster) if const_expr(t.cluster_n > 1) else None,
            smem=self.smem_bytes,
        )

    # -- the tile and its partition ---------------------------------------------------

    def atom(self, dtype: type[cutlass.Numeric]) -> cute.CopyAtom:
        """The copy atom of one ``vec``-element vector of ``dtype``."""
        return cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=self.tiling.vec * dtype.width
        )

    def thread_copy(self):
        """This thread's slice of the CTA tile: rows of threads, each thread ``vec`` columns."""
        t = self.tiling
        threads = cute.make_ordered_layout((t.rows_per_cta, t.threads_per_row), order=(1, 0))
        tiled = cute.make_tiled_copy_tv(
            self.atom(self.dtype), threads, cute.make_layout((1, t.vec))
        )
        return tiled.get_slice(cute.arch.thread_idx()[0])

    def cta_tile(self, ptr: cute.Pointer, row0: Int32, col0: Int32, rows: bool = True, cols=None):
        """The (R, C) tile of a row-major (M, n) tensor starting at (row0, col0), or with
        ``rows`` false of a length-n vector broadcast over the R rows; C is ``cols``, by
        default the CTA's columns."""
        t = self.tiling
        cols = t.cols_per_cta if const_expr(cols is None) else cols
        offset = Int64(row0) * t.n + Int64(col0) if const_expr(rows) else Int64(col0)
        nbytes = ptr.dtype.width // 8
        base = cute.make_ptr(
            ptr.dtype,
            ptr.toint() + offset * nbytes,
            cute.AddressSpace.gmem,
            assumed_align=t.vec * nbytes,
        )
        stride = t.n if const_expr(rows) else 0
        return cute.make_tensor(base, cute.make_layout((t.rows_per_cta, cols), stride=(stride, 1)))

    def setup(self, m: Int32, inputs, outputs, vectors=(), step=None) -> tuple[CtaView, Reduction]:
        """This CTA's reduction storage (cluster barriers armed) and its view of row block
        ``blockIdx.x`` (of one step's columns with ``step``: see ``view``)."""
        reduction = self.allocate_reduction(cutlass.memory.SmemAllocator())
        self.init_cluster(reduction.mbar)
        view = self.view(m, cute.arch.block_idx()[0], inputs, outputs, vectors, step)
        return view, reduction

    def view(self, m: Int32, block: Int32, inputs, outputs, vectors=(), step=None) -> CtaView:
        """This thread's partitions of row block ``block`` of each row-major (m, n) input
        and output, and of this CTA's columns of each length-n vector; with ``step``, of
        that step's columns only (streamed tilings: ``group`` vectors a thread)."""
        t = self.tiling
        row0 = block * t.rows_per_cta
        col0 = cute.arch.block_idx()[1] * t.cols_per_cta
        cols = t.cols_per_cta
        if const_expr(step is not None):
            col0, cols = col0 + step * t.step_cols, t.step_cols
        thr = self.thread_copy()
        sources = [thr.partition_S(self.cta_tile(p, row0, col0, cols=cols)) for p in inputs]
        destinations = [thr.partition_D(self.cta_tile(p, row0, col0, cols=cols)) for p in outputs]
        vecs = [
            thr.partition_S(self.cta_tile(p, row0, col0, rows=False, cols=cols)) for p in vectors
        ]
        tXcX = thr.partition_S(cute.make_identity_tensor((t.rows_per_cta, cols)))
        tXpX = None if const_expr(self.even_cols) else self.column_predicates(tXcX, col0)
        row = row0 + tXcX[0][0]
        first_col = col0 + tXcX[0][1] == 0
        return CtaView(sources, destinations, vecs, tXpX, row, row < m, first_col, tXcX, col0)

    def load(self, cta: CtaView, fills: tuple[float, ...]) -> list[cute.TensorSSA]:
        """This thread's values of every input as float32, each ``fill`` outside the tensor."""
        fragments = self._fragments(cta.sources, fills)
        self._copy_in(cta, cta.sources, fragments, cta.in_rows)
        return [f.load().to(Float32) for f in fragments]

    def load_vectors(self, cta: CtaView) -> list[cute.TensorSSA]:
        """This thread's columns of every broadcast vector as float32, zero outside the row.
        Vectors are read once per CTA, so their elements may be wider than a row's: a
        ``vec``-element access of them that exceeds 16 bytes is split (see ``copy_any``)."""
        fragments = self._fragments(cta.vectors, (0.0,) * len(cta.vectors))
        for src, dst in zip(cta.vectors, fragments, strict=True):
            self.copy_any(src, dst, cta.tXpX)
        return [f.load().to(Float32) for f in fragments]

    @cute.jit
    def copy_any(self, src: cute.Tensor, dst: cute.Tensor, tXpX):
        """Copy one thread's partition, by ``vec``-element accesses where they fit 16 bytes
        and element by element otherwise; vectors whose predicate is false are skipped."""
        if const_expr(self.tiling.vec * src.element_type.width <= 128):
            cute.copy(self.atom(src.element_type), src, dst, pred=tXpX)
        else:
            for v in cutlass.range_constexpr(cute.size(src, mode=[0, 1])):
                for j in cutlass.range_constexpr(cute.size(src, mode=[1])):
                    for k in cutlass.range_constexpr(cute.size(src, mode=[2])):
                        inside = True if const_expr(tXpX is None) else tXpX[v, j, k]
                        if inside:
                            for i in cutlass.range_constexpr(self.tiling.vec):
                                dst[(i, v), j, k] = src[(i, v), j, k]

    # -- persistent grids ---------------------------------------------------------------

    def allocate_stages(self, smem, dtypes) -> list:
        """Per input dtype, ``stages`` shared (R, C) tiles that row blocks are loaded into."""
        t = self.tiling
        layout = cute.make_ordered_layout(
            (self.stages, t.rows_per_cta, t.cols_per_cta), order=(2, 1, 0)
        )
        return [smem.allocate_tensor(d, layout, byte_alignment=16) for d in dtypes]

    def stage_bytes(self, itemsizes) -> int:
        """Shared memory for the staged row blocks; sets ``stages``, the blocks a CTA keeps
        (2 to 4: one in use, the rest in flight), within 3 * STAGE_BYTES."""
        t = self.tiling
        block = t.rows_per_cta * t.cols_per_cta
        self.stages = min(max(3 * STAGE_BYTES // max(block * sum(itemsizes), 1), 2), 4)
        return sum(-(-self.stages * block * e // 16) * 16 for e in itemsizes)

    @cute.jit
    def issue(self, m: Int32, block, inputs, stages: list, stage):
        """Start copying row block ``block`` of each input into shared tile ``stage``
        (cp.async, or a plain copy for vectors under 4 bytes), as one commit group."""
        cta = self.view(m, block, inputs, [])
        thr = self.thread_copy()
        if cta.in_rows:
            for i in cutlass.range_constexpr(len(inputs)):
                src = cta.sources[i]
                bits = self.tiling.vec * src.element_type.width
                op = cpasync.CopyG2SOp() if const_expr(bits >= 32) else cute.nvgpu.CopyUniversalOp()
                atom = cute.make_copy_atom(op, src.element_type, num_bits_per_copy=bits)
                dst = thr.partition_D(stages[i][stage, None, None])
                cute.copy(atom, src, dst, pred=cta.tXpX)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def take(self, cta: CtaView, stages: list, stage, fills) -> list:
        """This thread's values of shared tile ``stage`` of each input, as float32; ``fill``
        past the end of the row and for rows past the last."""
        thr = self.thread_copy()
        values = []
        for i in cutlass.range_constexpr(len(stages)):
            src = thr.partition_S(stages[i][stage, None, None])
            frag = cute.make_rmem_tensor_like(src)
            frag.fill(fills[i])
            if cta.in_rows:
                cute.copy(self.atom(src.element_type), src, frag, pred=cta.tXpX)
            values.append(frag.load().to(Float32))
        return values

    @cute.jit
    def pipeline(self, m: Int32, inputs, stages: list):
        """Start the loads of this CTA's first ``stages - 1`` row blocks."""
        first, stride = cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
        for s in cutlass.range_constexpr(self.stages - 1):
            self.issue(m, first + s * stride, inputs, stages, s)

    def advance(self, m: Int32, it, inputs, stages: list):
        """In iteration ``it``: start loading the block ``stages - 1`` ahead, wait for
        block ``it``; returns the shared tile that holds it."""
        first, stride = cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
        ahead = it + self.stages - 1
        self.issue(m, first + ahead * stride, inputs, stages, ahead % self.stages)
        cute.arch.cp_async_wait_group(self.stages - 1)
        return it % self.stages

    def start_cluster(self, smem) -> Reduction:
        """Allocate the reduction storage, arm the cluster barriers and wait until every
        peer has armed its own (a persistent kernel reduces in a loop, so waits up front)."""
        reduction = self.allocate_reduction(smem)
        self.init_cluster(reduction.mbar)
        if const_expr(self.tiling.cluster_n > 1):
            cute.arch.cluster_wait()
        return reduction

    def iterations(self, m: Int32):
        """Row blocks this CTA visits in a persistent grid: blockIdx.x, + gridDim.x, ..."""
        first, stride = cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
        return (cute.ceil_div(m, self.tiling.rows_per_cta) - first + stride - 1) // stride

    def _fragments(self, partitions, fills):
        fragments = []
        for tXgX, fill in zip(partitions, fills, strict=True):
            tXrX = cute.make_rmem_tensor_like(tXgX)
            tXrX.fill(fill)
            fragments.append(tXrX)
        return tuple(fragments)

    @cute.jit
    def _copy_in(self, cta: CtaView, partitions: list, fragments: tuple, when):
        if when:
            for i in cutlass.range_constexpr(len(fragments)):
                src = partitions[i]
                cute.copy(self.atom(src.element_type), src, fragments[i], pred=cta.tXpX)

    @cute.jit
    def store(self, cta: CtaView, values: cute.TensorSSA, tXgY: cute.Tensor):
        tXrY = cute.make_rmem_tensor_like(tXgY)
        tXrY.store(values.to(tXgY.element_type))
        if cta.in_rows:
            cute.copy(self.atom(tXgY.element_type), tXrY, tXgY, pred=cta.tXpX)

    @cute.jit
    def load_stat(self, cta: CtaView, ptr: cute.Pointer, m: Int32) -> Float32:
        """This thread's row of a float32 (m,) tensor (0 for rows past the end)."""
        value = Float32(0.0)
        if cta.in_rows:
            value = per_row(ptr, m)[cta.row]
        return value

    @cute.jit
    def store_stat(self, cta: CtaView, ptr: cute.Pointer, m: Int32, value: Float32):
        """Write this thread's row of a float32 (m,) tensor, once per row."""
        if cta.in_rows and cta.first_col:
            per_row(ptr, m)[cta.row] = value

    @cute.jit
    def rounded(self, values: cute.TensorSSA, dtype) -> cute.TensorSSA:
        """``values`` rounded to ``dtype`` (to nearest even) and back to float32. Done in
        PTX: the compiler folds a float32 -> bf16 -> float32 round trip to the identity."""
        out = values
        if const_expr(dtype is not Float32):
            name = {cutlass.BFloat16: "bf16", cutlass.Float16: "f16"}[dtype]
            frag = cute.make_rmem_tensor(values.shape, Float32)
            frag.store(values)
            for i in cutlass.range_constexpr(cute.size(frag)):
                frag[i] = cute.arch.inline_ptx(
                    f"{{\n\t.reg .b16 r;\n\tcvt.rn.{name}.f32 r, {{$r0}};\n\t"
                    f"cvt.f32.{name} {{$w0}}, r;\n\t}}",
                    write_only_types=[Float32],
                    read_only_args=[frag[i]],
                )
            out = frag.load()
        return out

    @cute.jit
    def fill_outside(self, cta: CtaView, values: cute.TensorSSA, fill=0.0) -> cute.TensorSSA:
        """``values`` with the vectors past the end of the row set to ``fill``."""
        out = values
        if const_expr(not self.even_cols):
            frag = cute.make_rmem_tensor(values.shape, Float32)
            frag.store(values)
            for v in cutlass.range_constexpr(cute.size(cta.tXpX, mode=[0])):
                for k in cutlass.range_constexpr(cute.size(cta.tXpX, mode=[2])):
                    for i in cutlass.range_constexpr(cute.size(frag, mode=[0, 0])):
                        frag[(i, v), 0, k] = cutlass.select_(
                            cta.tXpX[v, 0, k], frag[(i, v), 0, k], Float32(fill)
                        )
            out = frag.load()
        return out

    @cute.jit
    def column_predicates(self, tXcX: cute.Tensor, col0: Int32) -> cute.Tensor:
        """One predicate per vector: is its first column inside the row?"""
        tXpX = cute.make_rmem_tensor(
            cute.make_layout(
                (
                    cute.size(tXcX, mode=[0, 1]),
                    cute.size(tXcX, mode=[1]),
                    cute.size(tXcX, mode=[2]),
                ),
                stride=(cute.size(tXcX, mode=[2]), 0, 1),
            ),
            cutlass.Boolean,
        )
        for v in cutlass.range_constexpr(cute.size(tXpX, mode=[0])):
            for k in cutlass.range_constexpr(cute.size(tXpX, mode=[2])):
                tXpX[v, 0, k] = cute.elem_less(col0 + tXcX[(0, v), 0, k][1], self.tiling.n)
        return tXpX

    # -- reductions ---------------------------------------------------------------------

    def row_group_reduce(self, val, op):
        """Reduce over the lanes of a warp that share a row."""
        tpr = self.tiling.threads_per_row
        return cute.arch.warp_reduction(val, op, threads_in_group=min(tpr, cute.arch.WARP_SIZE))

    def allocate_reduction(self, smem) -> Reduction:
        """The mbarriers (clusters only) and ``copies`` buffers of (rows, warps x ranks,
        words) partials."""
        t = self.tiling
        mbar = None
        if const_expr(t.cluster_n > 1):
            mbar = smem.allocate_array(Int64, num_elems=max(self.copies, 2))
        buf = None
        if const_expr(self.needs_buffer):
            buf = smem.allocate_tensor(
                Float32,
                cute.make_ordered_layout(
                    (self.copies, t.rows_per_cta, t.warps_per_row * t.cluster_n, self.words),
                    order=(3, 2, 1, 0),
                ),
                byte_alignment=16,
            )
        return Reduction(buf, mbar)

    @cute.jit
    def init_cluster(self, mbar):
        """Arm the cluster barriers; peers must not store into us before this."""
        if const_expr(self.tiling.cluster_n > 1):
            if cute.arch.thread_idx()[0] == 0:
                for i in cutlass.range_constexpr(self.copies):
                    cute.arch.mbarrier_init(mbar + i, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.cluster_arrive_relaxed()

    @cute.jit
    def publish(self, vals, reduction: Reduction, copy, phase, first: cutlass.Constexpr[bool]):
        """Each warp stores its row's partials in slot (row, warp, rank) of buffer ``copy``
        of every CTA of the cluster; returns that buffer once every slot is written.

        A cluster's first reduction waits for every peer to arm its barriers. Buffers are
        reused round-robin: a CTA writes buffer k again only after its peers have passed
        the reduction that followed k's last use, so a kernel with ``copies`` = 2 can
        reduce in a loop with one barrier per round trip (``phase`` alternates every
        second use of a buffer).
        """
        t = self.tiling
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        row, wcol = warp // t.warps_per_row, warp % t.warps_per_row
        buf = reduction.buf[copy, None, None, None]
        if const_expr(t.cluster_n == 1):
            if lane == 0:
                for j in cutlass.range_constexpr(len(vals)):
                    buf[row, wcol, j] = vals[j]
            cute.arch.barrier()
        else:
            mbar = reduction.mbar + copy
            rank = cute.arch.block_idx_in_cluster()
            if const_expr(first):
                cute.arch.cluster_wait()
            if warp == 0:
                with cute.arch.elect_one():
                    nbytes = t.reduction_slots() * self.words * 4
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar, nbytes)
            if lane < t.cluster_n:
                slot = buf.iterator + cute.crd2idx((row, wcol * t.cluster_n + rank, 0), buf.layout)
                padding = (Float32(0.0),) * (self.words - len(vals))
                store_remote((*vals, *padding), slot, mbar, lane)
            cute.arch.mbarrier_wait(mbar, phase)
        return buf

    @cute.jit
    def gathered(self, buf, j: cutlass.Constexpr[int], fill: float):
        """Word j of the partials this lane reads back: slots lane, lane + 32, ..."""
        t = self.tiling
        slots = t.warps_per_row * t.cluster_n
        row = cute.arch.warp_idx() // t.warps_per_row
        lane = cute.arch.lane_idx()
        iters = const_expr(-(-slots // cute.arch.WARP_SIZE))
        out = cute.make_rmem_tensor(iters, Float32)
        out.fill(fill)
        for i in cutlass.range_constexpr(iters):
            if lane + i * cute.arch.WARP_SIZE < slots:
                out[i] = buf[row, lane + i * cute.arch.WARP_SIZE, j]
        return out

    @cute.jit
    def row_sums(
        self,
        values: tuple,
        reduction: Reduction,
        copy=0,
        phase=0,
        first: cutlass.Constexpr[bool] = False,
    ) -> tuple:
        """The sums over the whole row of each of ``values`` (this thread's elements), in
        one round trip through buffer ``copy`` (see ``publish``); ``first``: the cluster's
        first reduction, if ``start_cluster`` did not already wait for the peers."""
        sums = [
            self.row_group_reduce(
                v.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0), operator.add
            )
            for v in values
        ]
        if const_expr(self.needs_buffer):
            buf = self.publish(sums, reduction, copy, phase, first)
            sums = [
                cute.arch.warp_reduction(
                    self.gathered(buf, j, 0.0)
                    .load()
                    .reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0),
                    operator.add,
                )
                for j in range(len(values))
            ]
        return tuple(sums)

    @cute.jit
    def row_softmax(
        self,
        x: cute.TensorSSA,
        reduction: Reduction,
        t=None,
        t_times_e: bool = True,
        shift=None,
        scale=None,
    ):
        """Row statistics of softmax(x) (of softmax(scale * x) with a positive ``scale``)
        in one reduction round trip.

        Returns (m, s, e, w): the row max m of x, s = sum(exp(scale * (x - m))), this
        thread's e = exp(scale * (x - m)), and with a second operand t also
        w = sum(t * e), or sum(t) when ``t_times_e`` is false (None without t). Each warp
        reduces against its own max; the partials are rescaled to the row max when
        combined. An all -inf row gives
        m = -inf and s = 0, so softmax of it is NaN as in ``jax.nn.softmax``; a NaN or
        +inf anywhere makes s NaN. ``shift(m)`` is what exp is taken relative to
        (default ``finite_or_zero``; ``finite_or_zero_inf`` also shifts a +inf max by 0,
        so that s is +inf rather than NaN and ``shift(m) + log(s)`` is logsumexp's +inf).
        """
        shift = finite_or_zero if const_expr(shift is None) else shift
        log2_scale = LOG2_E if const_expr(scale is None) else LOG2_E * scale
        m = self.row_group_reduce(
            x.reduce(cute.ReductionOp.MAX, init_val=-Float32.inf, reduction_profile=0),
            cute.arch.fmax,
        )
        e = cute.math.exp2((x - shift(m)) * log2_scale, fastmath=True)
        s = e.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
        w = None
        if const_expr(t is not None):
            weighted = t * e if const_expr(t_times_e) else t
            w = weighted.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
        m_row, s, w = self.combine_softmax(m, s, w, reduction, t_times_e, shift, log2_scale, True)
        if const_expr(self.needs_buffer):
            e = e * cute.math.exp2((m - shift(m_row)) * log2_scale, fastmath=True)
        return m_row, s, e, w

    @cute.jit
    def streamed_softmax(
        self, values, reduction: Reduction, with_t: bool, t_times_e: bool, shift, scale
    ):
        """``row_softmax``'s (m, s, w) of a streamed tiling's rows, whose values this thread
        takes ``group`` vectors at a time: ``values(step)`` gives a step's (x, t). Each
        thread keeps a running max and rescales its sums when the max grows."""
        log2_scale = LOG2_E * scale
        mx, s, w = Float32(-Float32.inf), Float32(0.0), Float32(0.0)
        for step in cutlass.range(self.tiling.steps, unroll=1):
            x, t = values(step)
            top = cute.arch.fmax(
                mx, x.reduce(cute.ReductionOp.MAX, init_val=-Float32.inf, reduction_profile=0)
            )
            base = shift(top)
            rescale = cute.math.exp2((mx - base) * log2_scale, fastmath=True)
            e = cute.math.exp2((x - base) * log2_scale, fastmath=True)
            s = s * rescale + e.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
            if const_expr(with_t):
                weighted = t * e if const_expr(t_times_e) else t
                kept = w * rescale if const_expr(t_times_e) else w
                w = kept + weighted.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
            mx = top
        m_row, s, w = self.combine_softmax(
            mx, s, w if const_expr(with_t) else None, reduction, t_times_e, shift, log2_scale, False
        )
        return m_row, s, w

    @cute.jit
    def combine_softmax(
        self,
        m,
        s,
        w,
        reduction: Reduction,
        t_times_e: bool,
        shift,
        log2_scale,
        group_max: cutlass.Constexpr[bool],
    ):
        """The row's (max, sum of exponentials, [w]) from each thread's (m, s, w), its
        sums taken relative to ``shift(m)``: over the lanes that share the row, then (one
        round trip) over its warps and CTAs, each partial rescaled to the row's max.
        ``group_max``: m is already the max over the row's lanes of the warp."""
        if const_expr(not group_max):
            top = self.row_group_reduce(m, cute.arch.fmax)
            rescale = cute.math.exp2((m - shift(top)) * log2_scale, fastmath=True)
            s = s * rescale
            if const_expr(w is not None and t_times_e):
                w = w * rescale
            m = top
        s = self.row_group_reduce(s, operator.add)
        if const_expr(w is not None):
            w = self.row_group_reduce(w, operator.add)
        if const_expr(self.needs_buffer):
            buf = self.publish(
                (m, s) if const_expr(w is None) else (m, s, w), reduction, 0, 0, True
            )
            ms = self.gathered(buf, 0, -Float32.inf)
            m = cute.arch.warp_reduction(
                ms.load().reduce(cute.ReductionOp.MAX, init_val=-Float32.inf, reduction_profile=0),
                cute.arch.fmax,
            )
            base = shift(m)
            ss = self.gathered(buf, 1, 0.0)
            scales = cute.make_rmem_tensor(cute.size(ms), Float32)
            s_row = Float32(0.0)
            for i in cutlass.range_constexpr(cute.size(ms)):
                scales[i] = cute.math.exp2((ms[i] - base) * log2_scale, fastmath=True)
                s_row += ss[i] * scales[i]
            s = cute.arch.warp_reduction(s_row, operator.add)
            if const_expr(w is not None):
                ws = self.gathered(buf, 2, 0.0)
                if const_expr(t_times_e):
                    for i in cutlass.range_constexpr(cute.size(ms)):
                        ws[i] = ws[i] * scales[i]
                w = cute.arch.warp_reduction(
                    ws.load().reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0),
                    operator.add,
                )
        return m, s, w


def per_row(ptr: cute.Pointer, m: Int32) -> cute.Tensor:
    """The (m,) tensor of one value per row at ``ptr`` (statistics, labels)."""
    return cute.make_tensor(ptr, cute.make_layout(m))


def finite_or_zero(m: Float32) -> Float32:
    """The shift used for exp: a max of -inf (an all -inf or all-padding slice) shifts by 0."""
    return cutlass.select_(m == -Float32.inf, Float32(0.0), m)


def finite_or_zero_inf(m: Float32) -> Float32:
    """The shift of ``row_softmax`` for logsumexp: 0 for a max of -inf or +inf."""
    return cutlass.select_(m == Float32.inf, Float32(0.0), finite_or_zero(m))


@cute.jit
def store_remote(vals, slot: cute.Pointer, mbar: cute.Pointer, peer: Int32):
    """st.async float32 words ``vals`` to ``slot`` in CTA ``peer``, completing on its mbarrier."""
    addr = Int32(cute.arch.map_dsmem_ptr(slot, peer).toint())
    bar = Int32(cute.arch.map_dsmem_ptr(mbar, peer).toint())
    k = const_expr(len(vals))
    assert k in (1, 2, 4), "st.async stores 1, 2 or 4 words"
    if const_expr(k == 1):
        cute.arch.inline_ptx(
            "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [{$r0}], {$r1}, [{$r2}];",
            read_only_args=[addr, Float32(vals[0]), bar],
        )
    else:
        lanes = "xyzw"[:k]
        moves = "".join(f"mov.f32 v.{c}, {{$r{i + 1}}};\n\t" for i, c in enumerate(lanes))
        cute.arch.inline_ptx(
            f"{{\n\t.reg .v{k} .f32 v;\n\t{moves}"
            f"st.async.shared::cluster.mbarrier::complete_tx::bytes.v{k}.f32 "
            f"[{{$r0}}], v, [{{$r{k + 1}}}];\n\t}}",
            read_only_args=[addr, *[Float32(v) for v in vals], bar],
        )
