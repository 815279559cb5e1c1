"""Device experiment (issue 17, 2026-12-01): norm fwd+bwd at n = 65536 on each lowering
path, and the tuner at 2048 x 65536 bf16 RMSNorm."""

import json
import pathlib
import sys

import jax

from quack_jax import bench
from quack_jax._primitive import lowering_path

out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
rows = []
for name in ("rms_norm", "layer_norm"):
    op = bench.benchmarks()[name]
    cases = {c.key: c for c in op.cases}
    for dtype in ("bfloat16", "float32"):
        for m in (1024, 2048, 4096):
            n = 65536
            K = 4
            args = bench.make_inputs(op.arguments(m, n, dtype), K, seed=m)
            progs, keys = [], []
            for key, path in [
                ("quack_fwd_bwd", "kernel"),
                ("quack_fwd_bwd", "reference"),
                ("xla_fwd_bwd", "auto"),
                ("quack_fwd", "kernel"),
                ("xla_fwd", "auto"),
            ]:
                c = cases[key]
                structs = [
                    tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in t[: c.args]) for t in args
                ]
                with lowering_path(path):
                    compiled = bench.lower_calls(c.fn, structs).compile()
                progs.append((compiled, [t[: c.args] for t in args]))
                keys.append(f"{key}:{path}")
            secs = bench.time_compiled(progs, 10, 0.2)
            row = {"op": name, "dtype": dtype, "m": m, "n": n} | {
                k: s * 1e6 for k, s in zip(keys, secs, strict=True)
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
            del args, progs
(out / "norm_65536_paths.json").write_text(json.dumps(rows, indent=1))
op = bench.benchmarks()["rms_norm"]
row = bench.bench_shape(op, 2048, 65536, "bfloat16", 5, True, False)
(out / "tune_rms_2048x65536.json").write_text(json.dumps(row, indent=1, default=str))
