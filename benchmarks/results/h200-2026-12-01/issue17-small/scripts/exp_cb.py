"""Device experiment (issue 17, 2026-12-01): are the kernels' launches in XLA's command
buffers, and what do command buffers do to the chains' latency?"""

import json
import os
import sys

import jax
import jax.numpy as jnp

import quack_jax
from quack_jax import _ffi, bench
from quack_jax._primitive import lowering_path
from quack_jax._spec import fwd_bwd

K = 32
res = {"flags": os.environ.get("XLA_FLAGS", "")}
for m, n in [(8, 4096), (64, 8192), (1, 1024)]:
    s = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    progs = {}
    for name, fn, path in [
        ("xla", jax.nn.softmax, "auto"),
        ("quack_auto", quack_jax.softmax, "auto"),
        ("quack_kernel", quack_jax.softmax, "kernel"),
        ("quack_ref", quack_jax.softmax, "reference"),
    ]:
        with lowering_path(path):
            progs[name] = bench.lower_calls(fwd_bwd(fn), [(s, s)] * K, chain=True).compile()
    args = bench.make_inputs([((m, n), "bfloat16")] * 2, K, seed=m * n)
    captured = {}
    for name, c in progs.items():
        jax.block_until_ready(c(args))
        before = _ffi.captured_launches()
        for _ in range(10):
            out = c(args)
        jax.block_until_ready(out)
        captured[name] = (_ffi.captured_launches() - before) / 10
    secs = bench.time_compiled([(c, args) for c in progs.values()], 25, 0.1)
    res[f"{m}x{n}"] = {
        k: {"us": s * 1e6, "captured_per_call": captured[k]}
        for k, s in zip(progs, secs, strict=True)
    }
    print(json.dumps(res[f"{m}x{n}"]), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=1)
