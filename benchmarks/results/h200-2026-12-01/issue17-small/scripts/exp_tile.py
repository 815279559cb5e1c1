"""Device experiment (issue 17, 2026-12-01): softmax fwd and derivative kernels at small M
under each candidate tiling, chained as in bench --latency, beside XLA's."""

import concurrent.futures
import importlib
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

from quack_jax import bench
from quack_jax._primitive import lowering_path
from quack_jax._tiling import override_tiling

sm = importlib.import_module("quack_jax.softmax")
out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
op = bench.benchmarks()["softmax"]
tuned = {t.name: t for t in op.tuned}
K = 32


def xla_bwd(dy, y):
    return y * (dy - jnp.sum(dy * y, -1, keepdims=True))


rows = []
pool = concurrent.futures.ThreadPoolExecutor(16)
for n in (1024, 4096, 8192):
    for m in (1, 8, 64, 512):
        s = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
        progs = {}
        for name, t in tuned.items():
            for tag, tiling, _one_wave in t.runs(n, 2, None):
                with override_tiling(t.family, n, 2, tiling), lowering_path("kernel"):
                    args = [(s,)] if name == "fwd" else [(s, s)]
                    low = bench.lower_calls(t.fn, args * K, chain=True)
                progs[f"{name}:{tag}"] = (pool.submit(low.compile), 1 if name == "fwd" else 2)
        for key, fn, k in (("xla:fwd", jax.nn.softmax, 1), ("xla:bwd", xla_bwd, 2)):
            progs[key] = (pool.submit(bench.lower_calls(fn, [(s,) * k] * K, chain=True).compile), k)
        args = bench.make_inputs([((m, n), "bfloat16")] * 2, K, seed=m * n)
        y = [(a[0], jax.nn.softmax(a[0])) for a in args]
        timed = [(f.result(), [a[:1] for a in args] if k == 1 else y) for f, k in progs.values()]
        secs = bench.time_compiled(timed, 15, 0.05)
        row = {"m": m, "n": n} | {k: s * 1e6 for k, s in zip(progs, secs, strict=True)}
        print(
            json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}),
            flush=True,
        )
        rows.append(row)
(out / "softmax_tilings_small.json").write_text(json.dumps(rows, indent=1))
