"""Softmax forward at 32768 x 1024 (float32 and bfloat16) by kernel time, in one process
under ncu: the bench's copy, every candidate tiling of the tuner (the launched one first)
and, with --quack, QuACK's softmax, each run once per round between markers, for several
rounds.

    python exp_soft_1024.py build                  # on the CPU: the candidates' cubins
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
        --csv --print-units base --log-file DIR/ncu.csv python exp_soft_1024.py run DIR [--quack]
    python exp_soft_1024.py report DIR
"""

import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path.cwd()
sys.path[:0] = [str(ROOT / "benchmarks")]

M, N, ROUNDS = 32768, 1024, 5
DTYPES = {"float32": 4, "bfloat16": 2}


def candidates(dtype):
    import jax

    from quack_jax import bench

    op = bench.benchmarks()["softmax"]
    t = next(t for t in op.tuned if t.name == "fwd")
    args = [jax.ShapeDtypeStruct(s, d) for s, d, *_ in op.arguments(M, N, dtype)]
    return t, t.runs(N, DTYPES[dtype], bench.launched_tiling(t, args))


def build():
    import prebuild

    lows = [
        low
        for low in prebuild.tuning_lowerings(("softmax",))
        if any(low.label.startswith(f"softmax fwd {d} n={N} ") for d in DTYPES)
    ]
    prebuild.lower_for_cuda(lows, f"softmax fwd n={N} candidates")


def run(folder: pathlib.Path, quack: bool):
    import jax
    import profile_kernels

    import quack_jax
    from quack_jax import bench
    from quack_jax._tiling import override_tiling

    thunks = []
    for dtype, e in DTYPES.items():
        x = (jax.random.normal(jax.random.key(0), (M, N)) * 3).astype(dtype)
        words = jax.random.normal(jax.random.key(1), (M, N * e // 4))
        copy = jax.jit(lambda w: w * 2).lower(words).compile()
        thunks.append((f"{dtype} copy", lambda c=copy, a=words: jax.block_until_ready(c(a))))
        t, runs = candidates(dtype)
        for tag, tiling, one_wave in runs:
            with bench.persistent_grid(one_wave), override_tiling(t.family, N, e, tiling):
                compiled = jax.jit(quack_jax.softmax).lower(x).compile()
            bench.check_kernel(compiled)
            thunks.append((f"{dtype} {tag}", lambda c=compiled, a=x: jax.block_until_ready(c(a))))
        if quack:
            from quack_torch import DTYPES as TORCH_DTYPES
            from quack_torch import forward, inputs

            (arguments,) = inputs("softmax", M, N, TORCH_DTYPES[dtype], 1)
            fn = forward("softmax")
            thunks.append((f"{dtype} QuACK", lambda f=fn, a=arguments: f(*a)))
    rounds = [thunk for _ in range(ROUNDS) for thunk in thunks]
    profile_kernels.run_marked(rounds, folder / "labels.json", lambda _: None)


def report(folder: pathlib.Path):
    import profile_kernels

    labels = json.loads((folder / "labels.json").read_text())
    runs = profile_kernels.marked_runs(profile_kernels.ncu_kernels(folder / "ncu.csv"))
    times = {}
    for label, kernels in zip(labels, runs, strict=False):
        times.setdefault(label, []).append(sum(s for _, s in kernels) * 1e6)
    lines = [
        f"{len(runs)} marked runs for {len(labels)} labels; µs by ncu's gpu__time_duration",
        "",
        "| dtype | function | median µs | min | max | launched's median over this |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    launched = {}
    for label, us in times.items():
        dtype, name = label.split(" ", 1)
        med = statistics.median(us)
        if name not in ("copy", "QuACK"):
            launched.setdefault(dtype, med)  # the first candidate is the launched tiling
        ratio = launched[dtype] / med if dtype in launched else float("nan")
        lines.append(
            f"| {dtype} | {name} | {med:.2f} | {min(us):.2f} | {max(us):.2f} | {ratio:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    (folder / "softmax_1024.md").write_text(text)
    print(text)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "build":
        build()
    elif what == "run":
        run(pathlib.Path(sys.argv[2]), "--quack" in sys.argv)
    else:
        report(pathlib.Path(sys.argv[2]))
