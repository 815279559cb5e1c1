"""Softmax and log-softmax over the last axis: forward and derivative kernels.

Forward: one read of x and one write of y. Each thread keeps its slice of the row in
registers; the row max and the sum of exponentials travel together (online softmax), so
the whole row needs a single reduction round trip, across warps through shared memory and
across the CTAs of a cluster through distributed shared memory.

Derivatives map a (co)tangent t to the same shape and recompute p = softmax(x) from x in
registers, so they read t and x and write one output, and the forward output need not be
kept (it is not even computed when nothing else uses it):
    softmax (self-adjoint):      p * (t - sum(t * p))
    log_softmax, reverse (vjp):  t - p * sum(t)
    log_softmax, forward (jvp):  t - sum(p * t)
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .rowwise import LN_2, RowKernel, finite_or_zero


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
        row_max, row_sum, e, _ = self.row_softmax(x, buf, mbar)
        if const_expr(self.log):
            # (x - max) first: exact near the max, where x - lse would cancel.
            y = (x - finite_or_zero(row_max)) - cute.math.log2(row_sum, fastmath=True) * LN_2
        else:
            y = e * cute.arch.rcp_approx(row_sum)
        tXrY = cute.make_rmem_tensor_like(tXgY)
        tXrY.store(y.to(self.dtype))
        if in_rows:
            cute.copy(atom, tXrY, tXgY, pred=tXpX)


class SoftmaxDerivative(RowKernel):
    words = 4  # max, sum of exp, sum of t (times p): padded to one 16-byte st.async
    KINDS = ("softmax", "log_vjp", "log_jvp")

    def __init__(self, dtype, tiling, kind: str):
        super().__init__(dtype, tiling)
        assert kind in self.KINDS
        self.kind = kind

    @cute.jit
    def __call__(
        self,
        pt: cute.Pointer,
        px: cute.Pointer,
        pout: cute.Pointer,
        m: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(pt, px, pout, m).launch(**self.launch_args(m), stream=stream)

    @cute.kernel
    def kernel(self, pt: cute.Pointer, px: cute.Pointer, pout: cute.Pointer, m: Int32):
        t = self.tiling
        tidx, _, _ = cute.arch.thread_idx()
        bidx, rank, _ = cute.arch.block_idx()
        row0 = bidx * t.rows_per_cta
        col0 = rank * t.cols_per_cta
        gT, gX, gO = [self.cta_tile(p, row0, col0) for p in (pt, px, pout)]
        cX = cute.make_identity_tensor((t.rows_per_cta, t.cols_per_cta))

        smem = cutlass.memory.SmemAllocator()
        buf, mbar = self.allocate_reduction(smem)
        atom, tiled_copy = self.copies()
        thr = tiled_copy.get_slice(tidx)
        tXgT, tXgX, tXgO = thr.partition_S(gT), thr.partition_S(gX), thr.partition_D(gO)
        tXcX = thr.partition_S(cX)
        tXpX = None if const_expr(self.even_cols) else self.column_predicates(tXcX, col0)
        self.init_cluster(mbar)

        tXrT, tXrX = cute.make_rmem_tensor_like(tXgT), cute.make_rmem_tensor_like(tXgX)
        tXrT.fill(0.0)
        tXrX.fill(-tXrX.element_type.inf)
        in_rows = row0 + tXcX[0][0] < m
        if in_rows:
            cute.copy(atom, tXgT, tXrT, pred=tXpX)
            cute.copy(atom, tXgX, tXrX, pred=tXpX)
        tt = tXrT.load().to(Float32)
        x = tXrX.load().to(Float32)
        _, s, e, w = self.row_softmax(x, buf, mbar, t=tt, t_times_e=self.kind != "log_vjp")
        inv_s = cute.arch.rcp_approx(s)
        if const_expr(self.kind == "softmax"):
            out = (e * inv_s) * (tt - w * inv_s)
        elif const_expr(self.kind == "log_vjp"):
            out = tt - (e * inv_s) * w
        else:
            out = tt - w * inv_s
        tXrO = cute.make_rmem_tensor_like(tXgO)
        tXrO.store(out.to(self.dtype))
        if in_rows:
            cute.copy(atom, tXrO, tXgO, pred=tXpX)
