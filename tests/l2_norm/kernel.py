"""The toy l2_norm's kernel: y = x * rsqrt(sum(x^2) + eps), one row block per CTA."""

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32
from quack_jax.kernels.rowwise import RowKernel


class L2Norm(RowKernel):
    def compile_args(self):
        return self.pointer(self.dtype), self.pointer(self.dtype), Int32(0), Float32(0.0)

    @cute.jit
    def __call__(self, px, py, m: Int32, eps: Float32, stream: cuda.CUstream):
        self.kernel(px, py, m, eps).launch(**self.launch_args(m), stream=stream)

    @cute.kernel
    def kernel(self, px, py, m: Int32, eps: Float32):
        cta, reduction = self.setup(m, [px], [py])
        (x,) = self.load(cta, (0.0,))
        (squares,) = self.row_sums((x * x,), reduction, first=True)
        self.store(cta, x * cute.math.rsqrt(squares + eps, fastmath=True), cta.destinations[0])
