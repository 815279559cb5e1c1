"""The launch glue: the FFI library, its target, and the custom call that launches a cubin.

Why one generic target with the cubin as an attribute, and kernels that take pointers and
32-bit scalars: docs/decisions/002-one-ffi-launcher-target.md and 001-kernel-abi.md.
"""

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
            "(`pip install .` in its checkout builds it from ffi/launcher.cc)"
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


def max_active_clusters(kernel: CubinKernel, threads: int, cluster_n: int, device: int) -> int:
    """How many clusters of ``cluster_n`` CTAs of ``kernel``, ``threads`` threads each, CUDA
    device ``device`` runs at once (the driver's occupancy count)."""
    fn = load_library().QuackJaxMaxActiveClusters
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, *[ctypes.c_int] * 4]
    fn.argtypes += [ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_size_t]
    count, error = ctypes.c_int(0), ctypes.create_string_buffer(512)
    symbol = kernel.symbol.encode()
    args = (kernel.cubin, symbol, kernel.smem_bytes, threads, cluster_n, device)
    if fn(*args, ctypes.byref(count), error, len(error)):
        raise RuntimeError(error.value.decode())
    return count.value


def call(
    kernel: CubinKernel,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    cluster: tuple[int, int, int],
    scalars: tuple[int | float, ...],
    results,
    aliases: dict[int, int] | None = None,
):
    """A function of the operands that launches ``kernel`` once: pointers to the operands
    then to the ``results`` (shape-dtype structs, row-major), then the ``scalars``, each
    32 bits (ints as int32, floats as float32). ``aliases`` maps an operand's index to
    the result written over it (the kernel works in place: one buffer for both).

    A kernel whose parameters are not that many is an error here, at lowering, rather
    than a launch that reads the wrong arguments.

    With ``QUACK_JAX_POISON_OUTPUTS=1`` at lowering time the launcher fills the outputs
    with NaN first, so a test sees any element the kernel fails to write.
    """
    register_target()
    words = np.asarray(
        [np.float32(v).view(np.int32) if isinstance(v, float) else np.int32(v) for v in scalars],
        dtype=np.int32,
    )
    attributes = dict(
        cubin=np.frombuffer(kernel.cubin, dtype=np.uint8),
        cubin_hash=np.int64(kernel.digest),
        kernel=kernel.symbol,
        grid=np.asarray(grid, dtype=np.int64),
        block=np.asarray(block, dtype=np.int64),
        cluster=np.asarray(cluster, dtype=np.int64),
        smem=np.int64(kernel.smem_bytes),
        scalars=words,
        poison=np.int64(os.environ.get("QUACK_JAX_POISON_OUTPUTS") == "1"),
    )
    launch = jax.ffi.ffi_call(
        TARGET,
        [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results],
        input_output_aliases=aliases,
    )

    parameters = kernel.parameters  # read from the cubin once per call site

    def checked(*operands):
        passed = len(operands) + len(results) + len(scalars)
        if passed != parameters:
            raise RuntimeError(
                f"{kernel.symbol} takes {parameters} parameters; this call would pass "
                f"{passed} ({len(operands)} operands, {len(results)} results, "
                f"{len(scalars)} scalars)"
            )
        return launch(*operands, **attributes)

    return checked
