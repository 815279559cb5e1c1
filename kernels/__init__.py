"""quack_jax's CuTe-DSL kernels, compiled ahead of time to cubins.

This package imports ``cutlass`` and is only imported on a cache miss (or by
``python -m quack_jax.build``): the runtime needs the cubins alone. Compilation needs no
GPU. Every kernel takes its buffers as pointers (inputs, then outputs) followed by the
row count ``M`` as a 32-bit integer, which is the order the FFI launcher passes them in.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tempfile

# The DSL reads these once, when it is first imported; later compiles set them directly.
os.environ.setdefault("CUTE_DSL_KEEP", "cubin")

import cutlass
import cutlass.cute as cute
from cutlass.base_dsl.dsl import BaseDSL
from cutlass.cute.runtime import make_fake_stream, nullptr

from quack_jax._tiling import RowTiling

from .softmax import SoftmaxDerivative, SoftmaxForward

DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}

# op -> (kernel class, constructor options, number of buffer pointers)
KERNELS = {
    "softmax_fwd": (SoftmaxForward, {"log": False}, 2),
    "log_softmax_fwd": (SoftmaxForward, {"log": True}, 2),
    "softmax_bwd": (SoftmaxDerivative, {"kind": "softmax"}, 3),
    "log_softmax_bwd": (SoftmaxDerivative, {"kind": "log_vjp"}, 3),
    "log_softmax_jvp": (SoftmaxDerivative, {"kind": "log_jvp"}, 3),
}


@dataclasses.dataclass(frozen=True)
class Compiled:
    cubin: bytes
    symbol: str
    smem_bytes: int


def compile_kernel(op: str, dtype: str, tiling: RowTiling, arch: str) -> Compiled:
    """Compile one kernel configuration to a cubin for ``arch`` (for example ``sm_90a``)."""
    cls, options, num_pointers = KERNELS[op]
    kernel = cls(DTYPES[dtype], tiling, **options)
    envar = BaseDSL._get_dsl().envar
    align = tiling.vec * DTYPES[dtype].width // 8
    with tempfile.TemporaryDirectory(prefix="quack_jax_dsl_") as dump:
        envar.arch = arch
        envar.dump_dir = dump
        envar.keep_tokens = envar.keep_tokens | {"cubin"}
        envar.keep_cubin = True
        pointers = [
            nullptr(DTYPES[dtype], cute.AddressSpace.gmem, assumed_align=align)
            for _ in range(num_pointers)
        ]
        compiled = cute.compile(kernel, *pointers, cutlass.Int32(0), make_fake_stream())
        (symbol,) = compiled.kernel_info
        cubins = list(pathlib.Path(dump).glob("*.cubin"))
        if len(cubins) != 1:
            raise RuntimeError(f"CuTe-DSL wrote {len(cubins)} cubins for {op}, expected one")
        return Compiled(cubins[0].read_bytes(), symbol, kernel.smem_bytes)
