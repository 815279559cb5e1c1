"""The toy l2_norm's kernel: y = x * rsqrt(sum(x^2) + eps), one row block per CTA."""

import cutlass.cute as cute
from cutlass import Float32, Int32
from quack_jax.kernels.rowwise import RowKernel

from . import L2NormConfig


class L2Norm(RowKernel):
    scalars = L2NormConfig.scalar_types()

    def compile_args(self):
        return self.pointer(self.dtype), self.pointer(self.dtype), *self.scalar_args()

    @cute.kernel
    def kernel(self, px, py, m: Int32, eps: Float32):
        cta, reduction = self.setup(m, [px], [py])
        (x,) = self.load(cta, (0.0,))
        (squares,) = self.row_sums((x * x,), reduction, first=True)
        self.store(cta, x * cute.math.rsqrt(squares + eps, fastmath=True), cta.destinations[0])
