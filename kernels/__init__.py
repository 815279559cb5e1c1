"""quack_jax's CuTe-DSL kernels, compiled ahead of time to cubins.

This package imports ``cutlass`` and is only imported on a cache miss (or by
``python -m quack_jax.build``): the runtime needs the cubins alone. Compilation needs no
GPU. Every kernel takes its buffers as pointers (inputs, then outputs) followed by the
row count ``M`` and its other scalars, 32 bits each, which is the order the FFI launcher
passes them in; ``compile_args`` of each kernel class lists them.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
import tempfile

# The DSL reads these once, when it is first imported; later compiles set them directly.
os.environ.setdefault("CUTE_DSL_KEEP", "cubin")

import cutlass
import cutlass.cute as cute
from cutlass.base_dsl.dsl import BaseDSL
from cutlass.cute.runtime import make_fake_stream

from quack_jax import _registry
from quack_jax._tiling import RowTiling

DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


def kernel_class(op: str):
    """The kernel class of kernel op ``op`` and the options that select it, from its
    configuration (``KernelConfig.kernel_class`` and ``kernels``)."""
    config = _registry.kernel_configs()[op]
    module, name = config.kernel_class.split(":")
    module = module if "." in module else f"{__name__}.{module}"
    return getattr(importlib.import_module(module), name), config.kernels[op]


@dataclasses.dataclass(frozen=True)
class Compiled:
    cubin: bytes
    symbol: str
    smem_bytes: int


def compile_kernel(
    op: str, dtype: str, tiling: RowTiling, arch: str, variant: tuple = ()
) -> Compiled:
    """Compile one kernel configuration to a cubin for ``arch`` (for example ``sm_90a``).
    ``variant`` is (option, value) pairs for the kernel class; dtype names among the
    values become CuTe-DSL types."""
    cls, options = kernel_class(op)
    extra = {k: DTYPES.get(v, v) if isinstance(v, str) else v for k, v in variant}
    kernel = cls(DTYPES[dtype], tiling, **options, **extra)
    envar = BaseDSL._get_dsl().envar
    with tempfile.TemporaryDirectory(prefix="quack_jax_dsl_") as dump:
        envar.arch = arch
        envar.dump_dir = dump
        envar.keep_tokens = envar.keep_tokens | {"cubin"}
        envar.keep_cubin = True
        compiled = cute.compile(kernel, *kernel.compile_args(), make_fake_stream())
        (symbol,) = compiled.kernel_info
        cubins = list(pathlib.Path(dump).glob("*.cubin"))
        if len(cubins) != 1:
            raise RuntimeError(f"CuTe-DSL wrote {len(cubins)} cubins for {op}, expected one")
        return Compiled(cubins[0].read_bytes(), symbol, kernel.smem_bytes)
