"""The benchmark's timing: the jitted function that applies an op to K distinct inputs
(independently, or chained one after the other), the median time per application over
back-to-back calls, the check that a quack_jax function compiled to its kernels, and the
random inputs (see docs/decisions/021-benchmark-timing.md)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from quack_jax import _ffi
from quack_jax._primitive import kernel_arch

CALLS_PER_SAMPLE = 3


def kernel_device() -> bool:
    return kernel_arch(jax.devices()[0]) is not None


def describe() -> str:
    device = jax.devices()[0]
    if kernel_device():
        return f"{device.device_kind}: quack_jax runs its CuTe-DSL kernels (sm_90a)"
    return (
        f"{device.platform.upper()} ({device.device_kind}): no CUDA GPU with compute "
        "capability 9.0, so quack_jax ran its XLA fallback here and its columns time XLA"
    )


def chained(fn):
    """A function of K argument tuples that applies ``fn`` to each in turn: op k's
    arguments pass through an optimization barrier with op k-1's result, so op k cannot
    start before op k-1 ends, and XLA can neither fuse the K ops nor run them at once."""

    def f(inputs):
        results = []
        for args in inputs:
            if results:
                args, _ = jax.lax.optimization_barrier((args, results[-1]))
            results.append(fn(*args))
        return results

    return f


def lower_calls(fn, inputs, chain=False):
    """The jitted function that applies ``fn`` to each of the K argument tuples in
    ``inputs``, independently or with ``chain`` one after the other (see ``chained``),
    lowered (a ``lowering_path`` around this call applies)."""
    f = jax.jit(chained(fn) if chain else lambda inputs: [fn(*args) for args in inputs])
    return f.lower(inputs)


def time_compiled(programs, reps, warmup=0.0):
    """Median seconds per application of each compiled function in ``programs``, as
    (compiled, its K argument tuples), over its K tuples, after calls for ``warmup``
    seconds (at least one each). Their samples alternate, so a drift affects all alike."""
    end = time.perf_counter() + warmup
    for compiled, inputs in programs:
        jax.block_until_ready(compiled(inputs))
    while time.perf_counter() < end:
        for compiled, inputs in programs:
            jax.block_until_ready(compiled(inputs))
    times = [[] for _ in programs]
    for _ in range(reps):
        for (compiled, inputs), samples in zip(programs, times, strict=True):
            start = time.perf_counter()
            for _ in range(CALLS_PER_SAMPLE):
                out = compiled(inputs)
            jax.block_until_ready(out)
            samples.append(time.perf_counter() - start)
            del out
    return [
        statistics.median(samples) / (CALLS_PER_SAMPLE * len(inputs))
        for samples, (_, inputs) in zip(times, programs, strict=True)
    ]


def check_kernel(compiled):
    """Refuses a quack_jax function compiled without a kernel (it would time XLA)."""
    # the compiled program: with sharded inputs the kernels appear once XLA partitions it
    if _ffi.TARGET not in compiled.as_text():
        raise RuntimeError("the quack_jax path compiled without a kernel: refusing to time XLA")


def time_per_call(fn, inputs, reps, require_kernel=False):
    """Median seconds per application of ``fn`` over the K argument tuples in ``inputs``."""
    compiled = lower_calls(fn, inputs).compile()
    if require_kernel:
        check_kernel(compiled)
    return time_compiled([(compiled, inputs)], reps)[0]


def make_inputs(arguments, count, seed):
    """``count`` tuples of distinct random arrays, one per (shape, dtype): standard normal,
    or for (shape, "int32", high) integers in [0, high)."""
    keys = jax.random.split(jax.random.key(seed), (count, len(arguments)))

    def draw(k, shape, dtype, *high):
        if high:
            return jax.random.randint(k, shape, 0, high[0], jnp.int32)
        return jax.random.normal(k, shape, jnp.float32).astype(dtype)

    return [tuple(draw(k, *a) for k, a in zip(row, arguments, strict=True)) for row in keys]
