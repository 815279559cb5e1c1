"""The norm backward (bfloat16) by wall time, without a profiler (ncu crashed at the
start of exp_grid_summing.py in calls 1 and 2): XLA summing the weight-gradient partials
against the summing variant (``norm.SUM_MAX_BLOCKS`` 1 and 10**6), each a chain of K
backward ops in one jit (``bench.chained``), the two programs' samples alternating
(``bench.time_compiled``); µs per op, printed per shape as it is timed.

    python time_grid_summing.py
"""

import pathlib
import sys

ROOT = pathlib.Path.cwd()
sys.path[:0] = [str(ROOT / "benchmarks"), str(pathlib.Path(__file__).parent)]

import jax  # noqa: E402
from exp_grid_summing import CONFIGS, DTYPE, SHAPES  # noqa: E402

from quack_jax import bench, norm  # noqa: E402

print("| op | shape | K | xla-sum µs | summing µs | xla-sum over summing |", flush=True)
print("| --- | --- | --- | --- | --- | --- |", flush=True)
for name, shapes in SHAPES.items():
    op = bench.benchmarks()[name]
    t = next(t for t in op.tuned if t.name == "bwd")
    for m, n in shapes:
        k = 32 if m * n <= 4096 * 8192 else 8
        arguments = bench.make_inputs(op.arguments(m, n, DTYPE), k, seed=m * n)
        inputs = [tuple(jax.jit(t.prepare)(*a)) for a in arguments]
        programs = []
        for _, bound in CONFIGS:
            norm.SUM_MAX_BLOCKS = bound
            jax.clear_caches()
            compiled = bench.lower_calls(t.fn, inputs, chain=True).compile()
            bench.check_kernel(compiled)
            programs.append((compiled, inputs))
        xla_sum, summing = bench.time_compiled(programs, 15, 0.2)
        print(
            f"| {name} | {m}x{n} | {k} | {xla_sum * 1e6:.2f} | {summing * 1e6:.2f} "
            f"| {xla_sum / summing:.3f} |",
            flush=True,
        )
