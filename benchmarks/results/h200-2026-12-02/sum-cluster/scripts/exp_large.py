"""The norm backward alone (bfloat16, the backward kernel and XLA's sum of its partials)
at the benchmark's training shapes and a few small ones, by kernel time in one process
under ncu, three rounds: run once in this tree and once in a copy of the tree before the
summing cluster (``oldtree/``), to see whether the kernel's added code changed its time.

    python exp_large.py build                  # on the CPU: the kernels, into $QUACK_JAX_CACHE
    ncu ... --log-file DIR/ncu.csv python exp_large.py run DIR
    python exp_large.py report DIR
"""

import pathlib
import statistics
import sys

ROOT = pathlib.Path.cwd()
sys.path[:0] = [str(ROOT / "benchmarks")]

SHAPES = {
    "rms_norm": [
        (4096, 1024),
        (4096, 4096),
        (16384, 4096),
        (4096, 8192),
        (8192, 8192),
        (64, 8192),
        (512, 8192),
        (512, 1024),
    ],
    "layer_norm": [(4096, 2048), (16384, 4096), (8192, 8192), (512, 4096)],
}
ROUNDS = 3
DTYPE = "bfloat16"


def tuned(name, m, n):
    import jax

    from quack_jax import bench

    op = bench.benchmarks()[name]
    t = next(t for t in op.tuned if t.name == "bwd")
    return op, t, [jax.ShapeDtypeStruct(s, d) for s, d, *_ in op.arguments(m, n, DTYPE)]


def build():
    import jax

    from quack_jax.build import lower_for_cuda

    for name, shapes in SHAPES.items():
        for m, n in shapes:
            _, t, args = tuned(name, m, n)
            lower_for_cuda(t.fn, tuple(jax.eval_shape(t.prepare, *args)))


def run(folder: pathlib.Path):
    import jax
    import profile_kernels

    from quack_jax import bench

    thunks = []
    for name, shapes in SHAPES.items():
        for m, n in shapes:
            op, t, _ = tuned(name, m, n)
            (arguments,) = bench.make_inputs(op.arguments(m, n, DTYPE), 1, seed=m * n)
            operands = jax.jit(t.prepare)(*arguments)
            compiled = jax.jit(t.fn).lower(*operands).compile()
            bench.check_kernel(compiled)
            fn = lambda c=compiled, a=operands: jax.block_until_ready(c(*a))  # noqa: E731
            thunks.append((f"{name} {m}x{n}", fn))
    rounds = [thunk for _ in range(ROUNDS) for thunk in thunks]
    profile_kernels.run_marked(rounds, folder / "labels.json", lambda _: None)


def report(folders):
    import profile_kernels

    times = [profile_kernels.rounds(pathlib.Path(f)) for f in folders]
    lines = [
        "Median µs by ncu's gpu__time_duration (backward kernel + XLA's sum), three rounds; "
        f"columns: {', '.join(folders)}",
        "",
        "| label | " + " | ".join(folders) + " | first over second |",
        "| --- " * (len(folders) + 2) + "|",
    ]
    for label in times[0]:
        meds = [statistics.median(t[label][0]) if label in t else float("nan") for t in times]
        lines.append(
            f"| {label} | " + " | ".join(f"{x:.2f}" for x in meds) + f" | {meds[0] / meds[1]:.3f} |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "build":
        build()
    elif what == "run":
        run(pathlib.Path(sys.argv[2]))
    else:
        report(sys.argv[2:])
