"""Softmax and log-softmax over the last axis: forward and backward.

Forward: one read of x and one write of y. Each thread keeps its slice of the row in
registers; the row max and the sum of exponentials travel together (online softmax), so
the whole row needs a single reduction round trip, across warps through shared memory and
across the CTAs of a cluster through distributed shared memory.

The derivative kernels map a (co)tangent t to the same shape, from the saved output y:
    softmax (self-adjoint):      y * (t - sum(t * y))
    log_softmax, reverse (vjp):  t - exp(y) * sum(t)
    log_softmax, forward (jvp):  t - sum(exp(y) * t)
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .rowwise import LN_2, LOG2_E, RowKernel, finite_or_zero


class SoftmaxForward(RowKernel):
    words = 2

    def __init__(self, dtype, tiling, log: bool):
        super().__init__(dtype, tiling)
        self.log = log

    @cute.jit
    def __call__(self, px: cute.Pointer, py: cute.Pointer, m: Int32, stream: cuda.CUstream):
        self.kernel(px, py, m).launch(**self.launch_args(m), stream=stream)

    @cute.kernel
    def kernel(self, px: cute.Pointer, py: cute.Pointer, m: Int32):
        t = self.tiling
        tidx, _, _ = cute.arch.thread_idx()
        bidx, rank, _ = cute.arch.block_idx()
        row0 = bidx * t.rows_per_cta
        col0 = rank * t.cols_per_cta
        gX, gY = self.cta_tile(px, row0, col0), self.cta_tile(py, row0, col0)
        cX = cute.make_identity_tensor((t.rows_per_cta, t.cols_per_cta))

        smem = cutlass.memory.SmemAllocator()
        buf, mbar = self.allocate_reduction(smem)
        atom, tiled_copy = self.copies()
        thr = tiled_copy.get_slice(tidx)
        tXgX, tXgY, tXcX = thr.partition_S(gX), thr.partition_D(gY), thr.partition_S(cX)
        tXpX = None if const_expr(self.even_cols) else self.column_predicates(tXcX, col0)
        self.init_cluster(mbar)

        tXrX = cute.make_rmem_tensor_like(tXgX)
        tXrX.fill(-tXrX.element_type.inf)
        in_rows = row0 + tXcX[0][0] < m
        if in_rows:
            cute.copy(atom, tXgX, tXrX, pred=tXpX)
        x = tXrX.load().to(Float32)
        row_max, row_sum, e = self.row_max_sumexp(x, buf, mbar)
        if const_expr(self.log):
            lse = finite_or_zero(row_max) + cute.math.log2(row_sum, fastmath=True) * LN_2
            y = x - lse
        else:
            y = e * cute.arch.rcp_approx(row_sum)
        tXrY = cute.make_rmem_tensor_like(tXgY)
        tXrY.store(y.to(self.dtype))
        if in_rows:
            cute.copy(atom, tXrY, tXgY, pred=tXpX)


class SoftmaxDerivative(RowKernel):
    words = 1
    KINDS = ("softmax", "log_vjp", "log_jvp")

    def __init__(self, dtype, tiling, kind: str):
        super().__init__(dtype, tiling)
        assert kind in self.KINDS
        self.kind = kind

    @cute.jit
    def __call__(
        self,
        pdy: cute.Pointer,
        py: cute.Pointer,
        pdx: cute.Pointer,
        m: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(pdy, py, pdx, m).launch(**self.launch_args(m), stream=stream)

    @cute.kernel
    def kernel(self, pdy: cute.Pointer, py: cute.Pointer, pdx: cute.Pointer, m: Int32):
        t = self.tiling
        tidx, _, _ = cute.arch.thread_idx()
        bidx, rank, _ = cute.arch.block_idx()
        row0 = bidx * t.rows_per_cta
        col0 = rank * t.cols_per_cta
        gdY, gY, gdX = [self.cta_tile(p, row0, col0) for p in (pdy, py, pdx)]
        cX = cute.make_identity_tensor((t.rows_per_cta, t.cols_per_cta))

        smem = cutlass.memory.SmemAllocator()
        buf, mbar = self.allocate_reduction(smem)
        atom, tiled_copy = self.copies()
        thr = tiled_copy.get_slice(tidx)
        tXgdY, tXgY, tXgdX = thr.partition_S(gdY), thr.partition_S(gY), thr.partition_D(gdX)
        tXcX = thr.partition_S(cX)
        tXpX = None if const_expr(self.even_cols) else self.column_predicates(tXcX, col0)
        self.init_cluster(mbar)

        tXrdY, tXrY = cute.make_rmem_tensor_like(tXgdY), cute.make_rmem_tensor_like(tXgY)
        tXrdY.fill(0.0)
        tXrY.fill(0.0)
        in_rows = row0 + tXcX[0][0] < m
        if in_rows:
            cute.copy(atom, tXgdY, tXrdY, pred=tXpX)
            cute.copy(atom, tXgY, tXrY, pred=tXpX)
        dy = tXrdY.load().to(Float32)
        y = tXrY.load().to(Float32)
        if const_expr(self.kind == "log_vjp"):
            dx = dy - cute.math.exp2(y * LOG2_E, fastmath=True) * self.row_sum(dy, buf, mbar)
        elif const_expr(self.kind == "log_jvp"):
            dx = dy - self.row_sum(dy * cute.math.exp2(y * LOG2_E, fastmath=True), buf, mbar)
        else:
            dx = y * (dy - self.row_sum(dy * y, buf, mbar))
        tXrdX = cute.make_rmem_tensor_like(tXgdX)
        tXrdX.store(dx.to(self.dtype))
        if in_rows:
            cute.copy(atom, tXrdX, tXgdX, pred=tXpX)
