"""Device experiment (issue 17, seventh session): the norm backward with its partials in
the stages (branch plan/norm-bwd-partials-in-stages) against main's, one tree per process:
fwd+bwd of the kernels and of XLA at the bench's norm shapes and M = 4096 and QK-norm
shapes, the backward kernel alone at the tiling it launches, and every tuner candidate
of the backward at n = 4096 and 65536."""

import dataclasses
import json
import pathlib
import sys

import jax

from quack_jax import bench

out, tree = pathlib.Path(sys.argv[1]), sys.argv[2]
EXTRA = {
    "rms_norm": [
        (4096, 1024),
        (4096, 2048),
        (4096, 4096),
        (4096, 8192),
        (262144, 64),
        (262144, 128),
        (262144, 256),
        (2097152, 128),
    ],
    "layer_norm": [(4096, 1024), (4096, 2048), (4096, 4096), (4096, 8192)],
}
rows = []
for name in ("rms_norm", "layer_norm"):
    op = bench.benchmarks()[name]
    bwd = next(t for t in op.tuned if t.name == "bwd")
    cases = [c for c in op.cases if c.key in ("quack_fwd_bwd", "xla_fwd_bwd")]
    small = dataclasses.replace(op, cases=cases, tuned=[bwd])
    for dtype in ("bfloat16", "float32"):
        for m, n in op.shapes + (EXTRA[name] if dtype == "bfloat16" else []):
            e = bench.ITEMSIZE[dtype]
            row = bench.bench_shape(small, m, n, dtype, 5, False, False)
            arguments = bench.make_inputs(op.arguments(m, n, dtype), 4, seed=m * n)
            default = bench.launched_tiling(bwd, arguments[0])
            prepare = jax.jit(bwd.prepare)
            inputs = [prepare(*a) for a in arguments]
            runs = bwd.runs(n, e, default)
            if n not in (4096, 65536) or m < 2048:
                runs = runs[:1]
            res = row["tune_bwd"] = {}
            for tag, tiling, one_wave in runs:
                bench.tune_tiling(bwd, (dtype, m, n), tiling, tag, one_wave, inputs, 5, res)
            row |= {"op": name, "tree": tree, "default_bwd": default.tag if default else None}
            print(json.dumps(row, default=str), flush=True)
            rows.append(row)
            out.write_text(json.dumps(rows, indent=1, default=str))
            del arguments, inputs
