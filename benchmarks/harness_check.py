"""How much of QuACK's lead in the side-by-side report is the harness: a plain copy timed
by PyTorch (as ``quack_torch.py`` times QuACK) against JAX's copy, and quack_jax's ops timed
one jitted call per input from a Python loop (as PyTorch runs) against one jitted function
over all K inputs (``quack_jax.bench``'s own timing). bfloat16-sized arrays, K inputs of
about 4 GB in all, median of 7 samples of 3 rounds.

    python benchmarks/harness_check.py torch    # needs torch and CUDA
    python benchmarks/harness_check.py jax      # on the GPU, with the cubins
"""

import math
import statistics
import sys
import time

SHAPES = [
    ("softmax", 16384, 4096),
    ("softmax", 4096, 65536),
    ("rms_norm", 16384, 4096),
    ("rms_norm", 4096, 16384),
    ("cross_entropy", 4096, 128256),
    ("cross_entropy", 8192, 32000),
]
E = 2  # bfloat16


def median(sample, reps=7):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        sample()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def count(size):
    return max(4, math.ceil(4e9 / (2 * size)))


def torch_copy():
    import torch

    for _, m, n in SHAPES:
        size = m * n * E
        k = count(size)
        xs = [torch.randn(size // 4, device="cuda") for _ in range(k)]

        def eager(xs=xs):
            for _ in range(3):
                for x in xs:
                    x * 2
            torch.cuda.synchronize()

        eager()
        t = median(eager) / (3 * k)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for x in xs:
                x * 2

        def replay(graph=graph):
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()

        replay()
        tg = median(replay) / (3 * k)
        print(
            f"torch copy {m}x{n} bf16-size k={k}: eager {2 * size / t / 1e12:.3f} "
            f"graph {2 * size / tg / 1e12:.3f} TB/s",
            flush=True,
        )
        del xs, graph


def jax_ops():
    import jax
    import jax.numpy as jnp

    import quack_jax
    from quack_jax._timing import CALLS_PER_SAMPLE, time_per_call

    fns = {
        "softmax": (lambda x, labels, w: quack_jax.softmax(x), 2),
        "rms_norm": (lambda x, labels, w: quack_jax.rms_norm(x, w, eps=1e-6), 2),
        "cross_entropy": (lambda x, labels, w: quack_jax.cross_entropy(x, labels), 1),
    }
    for op, m, n in SHAPES:
        size = m * n * E
        k = count(size)
        keys = jax.random.split(jax.random.key(0), k)
        labels, w = jnp.zeros((m,), jnp.int32), jnp.ones((n,), jnp.float32)
        inputs = [(jax.random.normal(key, (m, n), jnp.bfloat16), labels, w) for key in keys]
        fn, passes = fns[op]
        one = jax.jit(fn)

        def per_call(one=one, inputs=inputs):
            for _ in range(CALLS_PER_SAMPLE):
                for args in inputs:
                    out = one(*args)
            jax.block_until_ready(out)

        per_call()
        seconds = median(per_call) / (CALLS_PER_SAMPLE * k)
        in_one = time_per_call(fn, inputs, 7)
        del inputs
        words = [(jax.random.normal(key, (size // 4,), jnp.float32),) for key in keys]
        copy = time_per_call(lambda v: v * 2, words, 7)
        del words
        print(
            f"jax {op} {m}x{n} bf16 k={k}: per-call {passes * size / seconds / 1e12:.3f} "
            f"K-in-one {passes * size / in_one / 1e12:.3f} TB/s; "
            f"copy K-in-one {2 * size / copy / 1e12:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    {"torch": torch_copy, "jax": jax_ops}[sys.argv[1]]()
