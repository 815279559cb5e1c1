"""First-call latency: seconds from a fresh process's first import to the first result of
one op, for quack_jax and for XLA's own formulation of the same op, each in a process of
its own (so JAX's start-up and the GPU's initialisation are in both).

    python benchmarks/first_call.py                      # prebuilt configs, on this machine
    python benchmarks/first_call.py --configs compiled   # a config that must be compiled

quack_jax's configs here are among the cubins packaged in the wheel (``python -m
quack_jax.build --packaged``): run it with an empty ``QUACK_JAX_CACHE`` to see what a user
with only the wheel gets. ``compiled`` times a row length outside the packaged set, which
needs CuTe-DSL on the machine (the kernel is compiled on first use).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

# name -> (shape of x, dtype, the quack_jax call, XLA's formulation)
CASES = {
    "rms_norm": (
        (16384, 4096),
        "bfloat16",
        "quack_jax.rms_norm(x, w)",
        "(x.astype(jnp.float32) * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), "
        "-1, keepdims=True) + 1e-6) * w).astype(x.dtype)",
    ),
    "softmax": (
        (65536, 2048),
        "bfloat16",
        "quack_jax.softmax(x)",
        "jax.nn.softmax(x.astype(jnp.float32)).astype(x.dtype)",
    ),
    "cross_entropy": (
        (4096, 128256),
        "bfloat16",
        "quack_jax.cross_entropy(x, labels)",
        "jnp.mean(jax.nn.logsumexp(x.astype(jnp.float32), -1) - jnp.take_along_axis("
        "x.astype(jnp.float32), labels[:, None], -1)[:, 0])",
    ),
}
COMPILED = ("rms_norm", (16384, 4000), "bfloat16")  # n=4000 is not packaged

CHILD = textwrap.dedent(
    """
    import time
    start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    {imports}
    imported = time.perf_counter()
    x = jax.random.normal(jax.random.key(0), {shape}, "{dtype}")
    w = jnp.ones({shape}[-1:], "{dtype}")
    labels = jnp.zeros({shape}[:1], jnp.int32)
    jax.block_until_ready((x, w, labels))
    ready = time.perf_counter()
    out = jax.jit(lambda x, w, labels: {call})(x, w, labels)
    jax.block_until_ready(out)
    done = time.perf_counter()
    print(imported - start, done - ready, done - start)
    """
)


def measure(shape, dtype, call, quack: bool, repeats: int) -> dict:
    """Median over fresh processes: import, first call (trace, compile, load, run), total."""
    code = CHILD.format(
        imports="import quack_jax" if quack else "", shape=shape, dtype=dtype, call=call
    )
    runs = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        runs.append([float(v) for v in out.stdout.split()[-3:]])
    imported, first, total = (statistics.median(col) for col in zip(*runs, strict=True))
    return dict(import_s=imported, first_call_s=first, total_s=total)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--configs", nargs="+", default=["prebuilt"], choices=["prebuilt", "compiled"]
    )
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    runs = []
    if "prebuilt" in args.configs:
        runs += [(name, shape, dtype, "prebuilt") for name, (shape, dtype, *_) in CASES.items()]
    if "compiled" in args.configs:
        runs.append((*COMPILED, "compiled"))
    rows = []
    for name, shape, dtype, config in runs:
        calls = dict(zip(("quack_jax", "XLA"), CASES[name][2:], strict=True))
        for impl, call in calls.items():
            # a compiled config is compiled once: its later processes would find it cached
            repeats = 1 if config == "compiled" and impl == "quack_jax" else args.repeats
            row = dict(op=name, shape=shape, dtype=dtype, impl=impl, config=config)
            rows.append(row | measure(shape, dtype, call, impl == "quack_jax", repeats))
            print(rows[-1], flush=True)
    print("| op | shape | impl | config | import s | first call s | total s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['op']} | {r['shape']} {r['dtype']} | {r['impl']} | {r['config']} | "
            f"{r['import_s']:.2f} | {r['first_call_s']:.2f} | {r['total_s']:.2f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
