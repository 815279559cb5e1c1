"""The norm backward at few rows (bfloat16), by kernel time in one process under ncu:
XLA summing the weight-gradient partials against the kernel summing them itself on a
grid of one cluster (``quack_jax.norm._summing_cluster``), for several cluster sizes and
row blocks per CTA, over several rounds. Each label's time is the backward kernel plus,
where XLA sums the partials, that reduction.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
        --csv --print-units base --log-file DIR/ncu.csv python exp_sum_cluster.py run DIR
    python exp_sum_cluster.py report DIR
"""

import pathlib
import statistics
import sys

ROOT = pathlib.Path.cwd()
sys.path[:0] = [str(ROOT / "benchmarks")]

SHAPES = {
    "rms_norm": [(m, n) for n in (1024, 2048, 4096, 8192) for m in (8, 16, 64, 128, 512)],
    "layer_norm": [(m, n) for n in (2048, 4096) for m in (8, 64, 512)],
}
# (label, SUM_CLUSTER_CTAS, SUM_CLUSTER_BLOCKS); the first is XLA summing the partials
CONFIGS = [("xla-sum", 1, 1), ("c8b1", 8, 1), ("c8b2", 8, 2), ("c8b4", 8, 4), ("c8b8", 8, 8)]
CONFIGS += [("c16b4", 16, 4)]
RULE = [("xla-sum", 1, 1), ("rule", 16, 2)]  # ``run DIR rule``: call 5's rule (16 CTAs)
ROUNDS = 3
DTYPE = "bfloat16"


def run(folder: pathlib.Path, configs=CONFIGS):
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
            for label, ctas, blocks in configs:
                norm.SUM_CLUSTER_CTAS, norm.SUM_CLUSTER_BLOCKS = ctas, blocks
                jax.clear_caches()
                try:
                    compiled = jax.jit(t.fn).lower(*operands).compile()
                    bench.check_kernel(compiled)
                    fn = lambda c=compiled, a=operands: jax.block_until_ready(c(*a))  # noqa: E731
                    fn()
                except Exception as e:  # a cluster the GPU cannot hold: recorded, skipped
                    print(f"{name} {m}x{n} {label}: {type(e).__name__}: {e}"[:300], flush=True)
                    continue
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
        "| op | shape | grid | kernels | median µs | min | max | xla-sum's median over this |",
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
    (folder / "sum_cluster.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(pathlib.Path(sys.argv[2]), RULE if sys.argv[3:] == ["rule"] else CONFIGS)
    else:
        report(pathlib.Path(sys.argv[2]))
