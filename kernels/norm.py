"""RMSNorm and LayerNorm over the last axis: forward and backward kernels.

Forward, one read of each input and one write of each output. The row ``h`` is x, or
with a residual ``x + residual`` rounded to x's dtype (what an unfused add gives; it is
also written out as the pre-norm residual stream, and the backward reads it back). Then,
in float32:
    LayerNorm: mean = sum(h) / n, rstd = rsqrt(sum((h - mean)^2) / n + eps)
    RMSNorm:   mean = 0,          rstd = rsqrt(sum(h^2) / n + eps)
    y = (h - mean) * rstd * (w + weight_offset) + b
LayerNorm sums the centred row in a second round trip instead of sum(h^2) / n - mean^2,
which cancels when the mean is large. rstd (and mean) are written per row, in float32,
for the backward.

Backward, with xhat = (h - mean) * rstd and g = dy * (w + weight_offset):
    dx = rstd * (g - xhat * sum(g * xhat) / n - sum(g) / n)    (RMSNorm: no sum(g) term)
plus the cotangent of h when the forward returned it (pre-norm blocks). The backward
keeps float32 running sums of dy * xhat (weight gradient) and dy (bias gradient) for
its columns; at the end a CTA combines its rows in shared memory and writes one row of
a (gridDim.x, n) float32 partial, which the caller sums. The ``summing`` variant, for
grids of few row blocks, is launched as one cluster along x and sums the partials
itself: after a cluster barrier each CTA sums a share of the columns over every CTA's
partial row, in row order, and writes the gradient, so that no further launch is
needed. (A variant of its own: as code in every backward kernel, the step changed how
ptxas compiled the main loop, and RMSNorm's backward at many rows ran 9-16% slower.)
No atomics: the result is the same bit for bit on every run with the same grid.

Both grids are persistent: each CTA reads the weights once, then walks row blocks
bx, bx + gridDim.x, ..., with the next blocks on their way into shared memory (cp.async)
while it works on the current one. A forward compiled without ``staged`` loads each
block straight into registers instead: for a grid of one CTA per row block, where
there is no next block to prefetch and the stages' shared memory would only cost
occupancy.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from quack_jax._tiling import round_up
from quack_jax.norm import config as configs

from .rowwise import RowKernel


class NormForward(RowKernel):
    copies = 2  # reductions alternate between two buffers
    scalars = configs.NormForward.scalar_types()

    def __init__(
        self, dtype, tiling, *, rms, residual=False, weight=None, bias=None, out=None, staged=True
    ):
        super().__init__(dtype, tiling)
        self.rms, self.residual, self.staged = rms, residual, staged
        self.weight, self.bias, self.out = weight, bias, out or dtype
        if staged:
            self.smem_bytes += self.stage_bytes([dtype.width // 8] * (1 + residual))

    def compile_args(self):
        p, stat = self.pointer, lambda: self.pointer(Float32, row=False)
        return (
            p(self.dtype),
            p(self.dtype) if self.residual else None,
            p(self.weight) if self.weight else None,
            p(self.bias) if self.bias else None,
            p(self.out),
            p(self.dtype) if self.residual else None,
            stat(),
            None if self.rms else stat(),
            *self.scalar_args(absent=() if self.weight else ("weight_offset",)),
        )

    @cute.kernel
    def kernel(self, px, pres, pw, pb, py, ph, prstd, pmean, m: Int32, eps, weight_offset):
        n = self.tiling.n
        inputs = [px, pres] if const_expr(self.residual) else [px]
        outputs = [py, ph] if const_expr(self.residual) else [py]
        smem = cutlass.memory.SmemAllocator()
        reduction = self.start_cluster(smem)
        if const_expr(self.staged):
            stages = self.allocate_stages(smem, [self.dtype] * len(inputs))
            self.pipeline(m, inputs, stages)
        first, stride = cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
        vectors = [v for v in (pw, pb) if const_expr(v is not None)]
        vecs = self.load_vectors(self.view(m, first, [], [], vectors))
        scale = vecs[0] + weight_offset if const_expr(self.weight is not None) else None
        fills = (0.0,) * len(inputs)
        for it in cutlass.range(self.iterations(m)):
            cta = self.view(m, first + it * stride, inputs, outputs)
            if const_expr(self.staged):
                rows = self.take(cta, stages, self.advance(m, it, inputs, stages), fills)
            else:
                rows = self.load(cta, fills)
            h = rows[0]
            if const_expr(self.residual):
                h = self.rounded(rows[0] + rows[1], self.dtype)
                self.store(cta, h, cta.destinations[1])
            if const_expr(self.rms):
                (squares,) = self.row_sums((h * h,), reduction, it % 2, (it // 2) % 2)
                centred = h
            else:
                (total,) = self.row_sums((h,), reduction, 0, it % 2)
                mean = total * (1.0 / n)
                self.store_stat(cta, pmean, m, mean)
                centred = self.fill_outside(cta, h - mean)
                (squares,) = self.row_sums((centred * centred,), reduction, 1, it % 2)
            rstd = cute.math.rsqrt(squares * (1.0 / n) + eps, fastmath=True)
            self.store_stat(cta, prstd, m, rstd)
            y = centred * rstd
            if const_expr(self.weight is not None):
                y = y * scale
            if const_expr(self.bias is not None):
                y = y + vecs[-1]
            self.store(cta, y, cta.destinations[0])


class NormBackward(RowKernel):
    copies = 2  # reductions alternate between two buffers
    scalars = configs.NormBackward.scalar_types()

    def __init__(
        self,
        dtype,
        tiling,
        *,
        rms,
        weight=None,
        dy=None,
        dh=False,
        weight_grad=False,
        bias_grad=False,
        summing=False,
    ):
        self.words = 1 if rms else 2
        super().__init__(dtype, tiling)
        self.rms, self.weight, self.dy, self.dh = rms, weight, dy or dtype, dh
        self.grads = [g for g, on in (("weight", weight_grad), ("bias", bias_grad)) if on]
        self.summing = summing
        self.row_dtypes = [self.dy, dtype] + [dtype] * dh
        self.smem_bytes += self.stage_bytes([d.width // 8 for d in self.row_dtypes])
        t = tiling
        # one (rows, columns) float32 tile per gradient to add up the rows of a CTA
        self.partial_tile = (t.rows_per_cta, t.cols_per_cta) if t.rows_per_cta > 1 else None
        if self.partial_tile:
            self.smem_bytes += len(self.grads) * round_up(t.rows_per_cta * t.cols_per_cta * 4, 16)

    def compile_args(self):
        p, stat = self.pointer, lambda: self.pointer(Float32, row=False)
        return (
            p(self.dy),
            p(self.dtype),
            p(self.weight) if self.weight else None,
            p(self.dtype) if self.dh else None,
            stat(),
            None if self.rms else stat(),
            p(self.dtype),
            *[p(Float32) if g in self.grads else None for g in ("weight", "bias")],
            *[p(Float32) if self.summing and g in self.grads else None for g in ("weight", "bias")],
            *self.scalar_args(absent=() if self.weight else ("weight_offset",)),
        )

    @cute.kernel
    def kernel(
        self,
        pdy,
        ph,
        pw,
        pdh,
        prstd,
        pmean,
        pdx,
        pdw,
        pdb,
        pdw_total,
        pdb_total,
        m: Int32,
        weight_offset,
    ):
        t = self.tiling
        n = t.n
        smem = cutlass.memory.SmemAllocator()
        reduction = self.start_cluster(smem)
        inputs = [pdy, ph, pdh] if const_expr(self.dh) else [pdy, ph]
        stages = self.allocate_stages(smem, self.row_dtypes)
        self.pipeline(m, inputs, stages)
        tiles = []
        if const_expr(self.partial_tile is not None):
            for _ in cutlass.range_constexpr(len(self.grads)):
                layout = cute.make_ordered_layout(self.partial_tile, order=(1, 0))
                tiles.append(smem.allocate_tensor(Float32, layout, byte_alignment=16))
        first, stride = cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
        start = self.view(
            m, first, inputs, [pdx], [pw] if const_expr(self.weight is not None) else []
        )
        w = None
        if const_expr(self.weight is not None):
            (w,) = self.load_vectors(start)
            w = w + weight_offset
        sums = []
        for _ in cutlass.range_constexpr(len(self.grads)):
            acc = cute.make_rmem_tensor_like(start.sources[0], Float32)
            acc.fill(0.0)
            sums.append(acc)
        fills = (0.0,) * len(inputs)
        for it in cutlass.range(self.iterations(m)):
            stage = self.advance(m, it, inputs, stages)
            cta = self.view(m, first + it * stride, inputs, [pdx])
            rows = self.take(cta, stages, stage, fills)
            dy, h = rows[0], rows[1]
            rstd = self.load_stat(cta, prstd, m)
            centred = h
            if const_expr(not self.rms):
                centred = h - self.load_stat(cta, pmean, m)
            xhat = centred * rstd
            g = dy * w if const_expr(self.weight is not None) else dy
            terms = (g * xhat,) if const_expr(self.rms) else (g * xhat, g)
            totals = self.row_sums(terms, reduction, it % 2, (it // 2) % 2)
            dx = g - xhat * (totals[0] * (1.0 / n))
            if const_expr(not self.rms):
                dx = dx - totals[1] * (1.0 / n)
            dx = dx * rstd
            if const_expr(self.dh):
                dx = dx + rows[2]
            self.store(cta, dx, cta.destinations[0])
            for i in cutlass.range_constexpr(len(self.grads)):
                grad = dy * xhat if const_expr(self.grads[i] == "weight") else dy
                sums[i].store(sums[i].load() + grad)
        partials = {"weight": pdw, "bias": pdb}
        for i in cutlass.range_constexpr(len(self.grads)):
            tile = tiles[i] if const_expr(self.partial_tile is not None) else None
            self.store_partial(start, sums[i], partials[self.grads[i]], tile)
        if const_expr(self.summing):
            totals = {"weight": pdw_total, "bias": pdb_total}
            self.sum_partials([(partials[g], totals[g]) for g in self.grads])

    @cute.jit
    def store_partial(self, start, acc, ptr, tile):
        """Add up this CTA's rows of ``acc`` and write them as row blockIdx.x of ``ptr``."""
        t = self.tiling
        thr = self.thread_copy()
        if const_expr(tile is not None):
            cute.autovec_copy(acc, thr.partition_D(tile))
            cute.arch.barrier()
        if cute.arch.thread_idx()[0] < t.threads_per_row:
            if const_expr(tile is not None):
                for r in cutlass.range_constexpr(1, t.rows_per_cta):
                    below = cute.make_tensor(tile.iterator + r * t.cols_per_cta, tile.layout)
                    acc.store(acc.load() + thr.partition_S(below).load())
            col0 = cute.arch.block_idx()[1] * t.cols_per_cta
            out = thr.partition_D(self.cta_tile(ptr, cute.arch.block_idx()[0], col0))
            self.copy_any(acc, out, start.tXpX)

    @cute.jit
    def sum_partials(self, pairs):
        """Where one cluster along x is the whole grid (not a cluster along y, which
        shares each row): once every CTA has written its partial rows, sum this CTA's
        share of the columns of each (partial, total) pair over the (gridDim.x, n)
        partial rows, in row order, into the length-n total."""
        if cute.arch.block_in_cluster_dim()[0] > 1:
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            n = self.tiling.n
            ctas, threads = cute.arch.grid_dim()[0], self.tiling.num_threads
            first = cute.arch.block_idx()[0] * threads + cute.arch.thread_idx()[0]
            for ptr, total in pairs:
                rows = cute.make_tensor(ptr, cute.make_layout((ctas, n), stride=(n, 1)))
                out = cute.make_tensor(total, cute.make_layout(n))
                for col in cutlass.range(first, n, ctas * threads):
                    acc = Float32(0.0)
                    for r in cutlass.range(ctas, unroll=4):
                        acc = acc + rows[r, col]
                    out[col] = acc
