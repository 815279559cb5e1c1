"""How much of QuACK's lead in the side-by-side report is the harness: a plain copy timed
by PyTorch (as ``quack_torch.py`` times QuACK) against JAX's copy, and quack_jax's ops timed
one jitted call per input from a Python loop (as PyTorch runs) against one jitted function
over all K inputs (as ``quack_jax.bench`` runs). bfloat16-sized arrays, K inputs of about
4 GB in all, median of 7 samples of 3 rounds.

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

    fns = {
        "softmax": (lambda x, labels, w: quack_jax.softmax(x), 2),
        "rms_norm": (lambda x, labels, w: quack_jax.rms_norm(x, w, eps=1e-6), 2),
        "cross_entropy": (lambda x, labels, w: quack_jax.cross_entropy(x, labels), 1),
    }
    for op, m, n in SHAPES:
        size = m * n * E
        k = count(size)
        keys = jax.random.split(jax.random.key(0), k)
        xs = [jax.random.normal(key, (m, n), jnp.bfloat16) for key in keys]
        labels, w = jnp.zeros((m,), jnp.int32), jnp.ones((n,), jnp.float32)
        fn, passes = fns[op]
        one = jax.jit(fn)
        many = jax.jit(lambda xs, fn=fn, labels=labels, w=w: [fn(x, labels, w) for x in xs])
        words = [jax.random.normal(key, (size // 4,), jnp.float32) for key in keys]
        copy = jax.jit(lambda ws: [v * 2 for v in ws])

        def per_call(one=one, xs=xs, labels=labels, w=w):
            for _ in range(3):
                for x in xs:
                    out = one(x, labels, w)
            jax.block_until_ready(out)

        def in_one(f, args):
            def rounds():
                for _ in range(3):
                    out = f(args)
                jax.block_until_ready(out)

            return rounds

        rates = []
        for sample, moved in (
            (per_call, passes),
            (in_one(many, xs), passes),
            (in_one(copy, words), 2),
        ):
            sample()
            rates.append(moved * size / (median(sample) / (3 * k)) / 1e12)
        print(
            f"jax {op} {m}x{n} bf16 k={k}: per-call {rates[0]:.3f} K-in-one {rates[1]:.3f} "
            f"TB/s; copy K-in-one {rates[2]:.3f}",
            flush=True,
        )
        del xs, words


if __name__ == "__main__":
    {"torch": torch_copy, "jax": jax_ops}[sys.argv[1]]()
