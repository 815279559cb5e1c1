"""Device experiment (issue 17, seventh session): softmax and log-softmax fwd+bwd at the
latency shapes, bf16, chains of 32 ops (µs per op): XLA; quack_jax by default (the
forward on XLA up to 8 MiB, the derivative kernel); its XLA reference forced (with the
optimization barrier of plan/softmax-derivative-reference); and the default with the
derivative sent to the reference at every size (a candidate REFERENCE_FASTER rule).
Fusions and custom calls per op from the optimised HLO."""

import contextlib
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp

import quack_jax
from quack_jax import _primitive, bench
from quack_jax._primitive import lowering_path
from quack_jax._spec import fwd_bwd

out = pathlib.Path(sys.argv[1])
DERIV = "quack_jax_softmax_derivative"


@contextlib.contextmanager
def derivative_on_xla(on):
    if on:
        _primitive.REFERENCE_FASTER[DERIV] = lambda *a, **k: True
    try:
        yield
    finally:
        _primitive.REFERENCE_FASTER.pop(DERIV, None)


FNS = {
    "xla": (jax.nn.softmax, "auto", False),
    "auto": (quack_jax.softmax, "auto", False),
    "ref": (quack_jax.softmax, "reference", False),
    "auto_dref": (quack_jax.softmax, "auto", True),
    "xla_log": (jax.nn.log_softmax, "auto", False),
    "auto_log": (quack_jax.log_softmax, "auto", False),
    "auto_log_dref": (quack_jax.log_softmax, "auto", True),
}
K = 32


def kernels_of(text):
    entry = text[text.index("ENTRY") :]
    return len(re.findall(r"= \S+ fusion\(", entry)), len(re.findall(r"custom-call\(", entry))


results = []
for m, n in bench.benchmarks()["softmax"].latency_shapes:
    progs, names = [], []
    structs = [(jax.ShapeDtypeStruct((m, n), jnp.bfloat16),) * 2] * K
    for name, (fn, path, dref) in FNS.items():
        with lowering_path(path), derivative_on_xla(dref):
            compiled = bench.lower_calls(fwd_bwd(fn), structs, chain=True).compile()
        text = compiled.as_text()
        if (m, n) in ((8, 4096), (64, 8192)):
            (out / f"hlo_{name}_{m}x{n}.txt").write_text(text)
        progs.append(compiled)
        names.append((name, kernels_of(text)))
    args = bench.make_inputs([((m, n), "bfloat16")] * 2, K, seed=m * n)
    secs = bench.time_compiled([(c, args) for c in progs], 25, 0.1)
    row = {"m": m, "n": n}
    for (name, (fus, cc)), s in zip(names, secs, strict=True):
        row[name] = {"us": s * 1e6, "fusions_per_op": fus / K, "custom_calls_per_op": cc / K}
    print(json.dumps(row), flush=True)
    results.append(row)
    (out / "softmax_paths.json").write_text(json.dumps(results, indent=1))
