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

from quack_jax._configs import KernelConfig
from quack_jax._tiling import RowTiling

DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


def kernel_class(path: str):
    """The kernel class that ``KernelConfig.kernel_class`` names: "module:Class", a module
    of this package by its name, any other by its full path."""
    module, name = path.split(":")
    module = module if "." in module else f"{__name__}.{module}"
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class Compiled:
    cubin: bytes
    symbol: str
    smem_bytes: int


def compile_kernel(config: KernelConfig, dtype: str, tiling: RowTiling, arch: str) -> Compiled:
    """Compile the kernel of ``config`` for rows of ``dtype`` with ``tiling`` to a cubin for
    ``arch`` (for example ``sm_90a``). Its class is built with the values of the fields
    that select its kernel op and with its variant, whose dtype names become CuTe-DSL
    types."""
    op = config.op
    extra = {k: DTYPES.get(v, v) if isinstance(v, str) else v for k, v in config.variant()}
    kernel = kernel_class(config.kernel_class)(DTYPES[dtype], tiling, **config.kernels[op], **extra)
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
