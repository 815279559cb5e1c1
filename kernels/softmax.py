"""Softmax and log-softmax over the last axis: forward and derivative kernels.

Forward: one read of x and one write of y. Each thread keeps its slice of the row in
registers; the row max and the sum of exponentials travel together (online softmax), so
the whole row needs a single reduction round trip, across warps through shared memory and
across the CTAs of a cluster through distributed shared memory.

Derivatives map a (co)tangent t to the same shape; they read t and one saved operand s
and write one output. Softmax's reads its forward output y (s = y), so it needs only the
row sum of t * y: one value per row in one round trip. Log-softmax's recompute
p = softmax(x) from x (s = x) in registers: a 16-bit log-probability would give p only
to |log p| * 2^-8 relative.
    softmax (self-adjoint), s = y:  y * (t - sum(t * y))
    log_softmax, reverse (vjp):     t - p * sum(t)
    log_softmax, forward (jvp):     t - sum(p * t)
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, const_expr

from .rowwise import LN_2, RowKernel, finite_or_zero


class SoftmaxForward(RowKernel):
    words = 2

    def __init__(self, dtype, tiling, log: bool):
        super().__init__(dtype, tiling)
        self.log = log

    def compile_args(self):
        return self.pointer(self.dtype), self.pointer(self.dtype), *self.scalar_args()

    @cute.kernel
    def kernel(self, px: cute.Pointer, py: cute.Pointer, m: Int32):
        cta, reduction = self.setup(m, [px], [py])
        (x,) = self.load(cta, (-float("inf"),))
        row_max, row_sum, e, _ = self.row_softmax(x, reduction)
        if const_expr(self.log):
            # (x - max) first: exact near the max, where x - lse would cancel.
            y = (x - finite_or_zero(row_max)) - cute.math.log2(row_sum, fastmath=True) * LN_2
        else:
            y = e * cute.arch.rcp_approx(row_sum)
        self.store(cta, y, cta.destinations[0])


class SoftmaxDerivative(RowKernel):
    KINDS = ("softmax", "log_vjp", "log_jvp")

    def __init__(self, dtype, tiling, kind: str):
        assert kind in self.KINDS
        # softmax: sum of t * y; log-softmax: max, sum of exp, sum of t (times p), padded
        # to one 16-byte st.async
        self.words = 1 if kind == "softmax" else 4
        super().__init__(dtype, tiling)
        self.kind = kind

    def compile_args(self):
        return (*(self.pointer(self.dtype) for _ in range(3)), *self.scalar_args())

    @cute.kernel
    def kernel(self, pt: cute.Pointer, ps: cute.Pointer, pout: cute.Pointer, m: Int32):
        cta, reduction = self.setup(m, [pt, ps], [pout])
        if const_expr(self.kind == "softmax"):
            tt, y = self.load(cta, (0.0, 0.0))
            (w,) = self.row_sums((tt * y,), reduction, first=True)
            out = y * (tt - w)
        else:
            tt, x = self.load(cta, (0.0, -float("inf")))
            _, s, e, w = self.row_softmax(x, reduction, t=tt, t_times_e=self.kind == "log_jvp")
            inv_s = cute.arch.rcp_approx(s)
            out = tt - (e * inv_s) * w if const_expr(self.kind == "log_vjp") else tt - w * inv_s
        self.store(cta, out, cta.destinations[0])
