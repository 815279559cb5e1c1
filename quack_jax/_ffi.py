"""The launch glue: the FFI library, its target, and the custom call that launches a cubin."""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib

import jax
import numpy as np

from ._cache import CubinKernel

TARGET = "quack_jax_launch"
LIBRARY = pathlib.Path(__file__).with_name("libquack_jax_ffi.so")


@functools.cache
def load_library() -> ctypes.CDLL:
    if not LIBRARY.exists():
        raise RuntimeError(
            f"quack_jax's FFI library is missing at {LIBRARY}: reinstall quack_jax "
            "(pip install builds it from ffi/launcher.cc)"
        )
    return ctypes.CDLL(str(LIBRARY))


@functools.cache
def register_target() -> None:
    """Register the launcher for CUDA, once per process (no GPU needed to register)."""
    lib = load_library()
    jax.ffi.register_ffi_target(
        TARGET,
        {
            "initialize": jax.ffi.pycapsule(lib.QuackJaxLaunchInitialize),
            "execute": jax.ffi.pycapsule(lib.QuackJaxLaunch),
        },
        platform="CUDA",
    )


def captured_launches() -> int:
    """Kernel launches so far that XLA recorded into CUDA graphs (command buffers)."""
    lib = load_library()
    lib.QuackJaxCapturedLaunches.restype = ctypes.c_int64
    return lib.QuackJaxCapturedLaunches()


def launch(
    ctx,
    operands,
    kernel: CubinKernel,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    cluster: tuple[int, int, int],
    scalars: tuple[int, ...],
):
    """Lower to one launch of ``kernel``: pointers to ``operands`` then to the results
    (shapes from ``ctx.avals_out``, row-major), then the 32-bit ``scalars``.

    With ``QUACK_JAX_POISON_OUTPUTS=1`` at lowering time the launcher fills the outputs
    with NaN first, so a test sees any element the kernel fails to write.
    """
    register_target()
    return jax.ffi.ffi_lowering(TARGET)(
        ctx,
        *operands,
        cubin=np.frombuffer(kernel.cubin, dtype=np.uint8),
        cubin_hash=kernel.digest,
        kernel=kernel.symbol,
        grid=np.asarray(grid, dtype=np.int64),
        block=np.asarray(block, dtype=np.int64),
        cluster=np.asarray(cluster, dtype=np.int64),
        smem=kernel.smem_bytes,
        scalars=np.asarray(scalars, dtype=np.int32),
        poison=int(os.environ.get("QUACK_JAX_POISON_OUTPUTS") == "1"),
    )
