"""The norm backward (bfloat16) by kernel time in one process under ncu: XLA summing the
weight-gradient partials against the kernel summing them itself on clusters of 8 CTAs
(the summing variant, on any number of row blocks: ``quack_jax.norm.SUM_MAX_BLOCKS``
raised), over several rounds. Each label's time is the backward kernel plus, where XLA
sums the partials, that reduction. The rows reach past the summing variant's final
bound, to find it.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
        --csv --print-units base --log-file DIR/ncu.csv python exp_grid_summing.py run DIR
    python exp_grid_summing.py report DIR
"""

import pathlib
import statistics
import sys

ROOT = pathlib.Path.cwd()
sys.path[:0] = [str(ROOT / "benchmarks")]

ROWS = (8, 64, 128, 512, 1024, 2048, 4096, 16384)
SHAPES = {
    "rms_norm": [(m, n) for n in (1024, 2048, 4096, 8192) for m in ROWS],
    "layer_norm": [(m, n) for n in (1024, 4096, 8192) for m in ROWS[1::2]],
}
CONFIGS = [("xla-sum", 1), ("summing", 10**6)]  # (label, SUM_MAX_BLOCKS)
ROUNDS = 3
DTYPE = "bfloat16"


def run(folder: pathlib.Path):
    import jax
    import profile_kernels

    from quack_jax import bench, norm

    thunks = []
    for name, shapes in SHAPES.items():
        op = bench.benchmarks()[name]
        t = next(t for t in op.tuned if t.name == "bwd")
        for m, n in shapes:
            (arguments,) = bench.make_inputs(op.arguments(m, n, DTYPE), 1, seed=m * n)
            operands = jax.jit(t.prepare)(*arguments)
            for label, bound in CONFIGS:
                norm.SUM_MAX_BLOCKS = bound
                jax.clear_caches()
                compiled = jax.jit(t.fn).lower(*operands).compile()
                bench.check_kernel(compiled)
                fn = lambda c=compiled, a=operands: jax.block_until_ready(c(*a))  # noqa: E731
                fn()
                thunks.append((f"{name} {m}x{n} {label}", fn))
    rounds = [thunk for _ in range(ROUNDS) for thunk in thunks]
    profile_kernels.run_marked(rounds, folder / "labels.json", lambda _: None)


def report(folder: pathlib.Path):
    import profile_kernels

    times = profile_kernels.rounds(folder)
    lines = [
        f"{sum(len(us) for us, _ in times.values())} marked runs for {len(times)} labels; µs "
        "by ncu's gpu__time_duration (the backward kernel, and XLA's sum of its partials "
        "where it runs)",
        "",
        "| op | shape | config | kernels | median µs | min | max | xla-sum's median over this |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {}
    for label, (us, kernels) in times.items():
        name, shape, config = label.split(" ")
        med = statistics.median(us)
        base.setdefault((name, shape), med)  # the first config is XLA summing
        lines.append(
            f"| {name} | {shape} | {config} | {kernels} | {med:.2f} | {min(us):.2f} "
            f"| {max(us):.2f} | {base[name, shape] / med:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    (folder / "grid_summing.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(pathlib.Path(sys.argv[2]))
    else:
        report(pathlib.Path(sys.argv[2]))
