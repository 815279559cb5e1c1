"""The RMSNorm backward at few rows (bfloat16, 8 to 512 rows of 4096 and 8192), by
kernel time in one process under ncu: each candidate tiling of the tuner (the launched
one first), each with the reduction of its weight-gradient partials, for several rounds.

    python exp_norm_small.py build                  # on the CPU: the candidates' cubins
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
        --csv --print-units base --log-file DIR/ncu.csv python exp_norm_small.py run DIR
    python exp_norm_small.py report DIR
"""

import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path.cwd()
sys.path[:0] = [str(ROOT / "benchmarks")]

SHAPES = [(m, n) for n in (4096, 8192) for m in (8, 64, 512)]
ROUNDS = 3
DTYPE = "bfloat16"


def tuned(m, n):
    """The backward's Tuned, its operands' structs at (m, n), and the tuner's runs."""
    import jax

    from quack_jax import bench

    op = bench.benchmarks()["rms_norm"]
    t = next(t for t in op.tuned if t.name == "bwd")
    args = [jax.ShapeDtypeStruct(s, d) for s, d, *_ in op.arguments(m, n, DTYPE)]
    return op, t, args, t.runs(n, 2, bench.launched_tiling(t, args))


def build():
    import jax
    import prebuild

    lows = []
    for m, n in SHAPES[::3]:  # the tilings depend on n only
        _, t, args, runs = tuned(m, n)
        operands = tuple(jax.eval_shape(t.prepare, *args))
        for tag, tiling, one_wave in runs:
            label = f"rms_norm bwd n={n} {tag}"
            lows.append(
                prebuild.Lowering(label, t.fn, operands, (t.family, n, 2, tiling), True, one_wave)
            )
    prebuild.lower_for_cuda(lows, "rms_norm bwd candidates")


def run(folder: pathlib.Path):
    import jax
    import profile_kernels

    from quack_jax import bench
    from quack_jax._tiling import override_tiling

    thunks = []
    for m, n in SHAPES:
        op, t, _, runs = tuned(m, n)
        (arguments,) = bench.make_inputs(op.arguments(m, n, DTYPE), 1, seed=m * n)
        operands = jax.jit(t.prepare)(*arguments)
        for tag, tiling, one_wave in runs:
            with bench.persistent_grid(one_wave), override_tiling(t.family, n, 2, tiling):
                compiled = jax.jit(t.fn).lower(*operands).compile()
            bench.check_kernel(compiled)
            fn = lambda c=compiled, a=operands: jax.block_until_ready(c(*a))  # noqa: E731
            thunks.append((f"{m}x{n} {tag}", fn))
    rounds = [thunk for _ in range(ROUNDS) for thunk in thunks]
    profile_kernels.run_marked(rounds, folder / "labels.json", lambda _: None)


def report(folder: pathlib.Path):
    import profile_kernels

    labels = json.loads((folder / "labels.json").read_text())
    runs = profile_kernels.marked_runs(profile_kernels.ncu_kernels(folder / "ncu.csv"))
    times, kernels = {}, {}
    for label, ks in zip(labels, runs, strict=False):
        times.setdefault(label, []).append(sum(s for _, s in ks) * 1e6)
        kernels[label] = len(ks)
    lines = [
        f"{len(runs)} marked runs for {len(labels)} labels; µs by ncu's gpu__time_duration "
        "(the backward kernel and the reduction of its partials)",
        "",
        "| shape | tiling | kernels | median µs | min | max | launched's median over this |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    launched = {}
    for label, us in times.items():
        shape, tag = label.split(" ", 1)
        med = statistics.median(us)
        launched.setdefault(shape, med)  # the first candidate is the launched tiling
        lines.append(
            f"| {shape} | {tag} | {kernels[label]} | {med:.2f} | {min(us):.2f} | {max(us):.2f} "
            f"| {launched[shape] / med:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    (folder / "rms_norm_bwd_small.md").write_text(text)
    print(text)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "build":
        build()
    elif what == "run":
        run(pathlib.Path(sys.argv[2]))
    else:
        report(pathlib.Path(sys.argv[2]))
