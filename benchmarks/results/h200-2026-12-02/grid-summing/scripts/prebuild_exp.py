"""The kernels of the experiment's device call, built on a machine without a GPU: the
norm GPU tests' cases with the summing variant at any number of row blocks (as
``unbounded.py`` makes the tests run), and ``exp_grid_summing.py``'s backward under both
of its configurations.

    python prebuild_exp.py CACHE
"""

import os
import pathlib
import sys

ROOT = pathlib.Path.cwd()
sys.path[:0] = [str(ROOT / "benchmarks"), str(pathlib.Path(__file__).parent)]
os.environ["QUACK_JAX_CACHE"] = sys.argv[1]

import exp_grid_summing as exp  # noqa: E402
import jax  # noqa: E402
import prebuild  # noqa: E402

from quack_jax import bench, norm  # noqa: E402


def exp_lowerings():
    out = []
    for name, shapes in exp.SHAPES.items():
        op = bench.benchmarks()[name]
        t = next(t for t in op.tuned if t.name == "bwd")
        for m, n in shapes:
            args = [jax.ShapeDtypeStruct(s, d) for s, d, *_ in op.arguments(m, n, exp.DTYPE)]
            operands = tuple(jax.eval_shape(t.prepare, *args))
            out.append(prebuild.Lowering(f"{name} bwd {m}x{n}", t.fn, operands))
    return out


for _, bound in exp.CONFIGS:
    norm.SUM_MAX_BLOCKS = bound
    prebuild.lower_for_cuda(exp_lowerings(), f"experiment, SUM_MAX_BLOCKS={bound}")
norm.SUM_MAX_BLOCKS = 10**6
prebuild.lower_for_cuda(prebuild.case_lowerings(["test_norm"]), "test_norm, unbounded")
