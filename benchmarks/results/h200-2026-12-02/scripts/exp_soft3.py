"""Device experiment (issue 17, eighth session): the diamond formulations of softmax's reference
derivative (kind softmax) for XLA's fusions: fwd+bwd chains of 32 (µs per op), bf16, at
the latency shapes, with fusions and custom calls per op, and each formulation's largest
error against float64."""

import contextlib
import importlib
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import quack_jax
from quack_jax import _primitive, bench
from quack_jax._partition import WHOLE
from quack_jax._primitive import compute_dtype, lowering_path
from quack_jax._spec import fwd_bwd

sm = importlib.import_module("quack_jax.softmax")
out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
ORIGINAL = sm._derivative.reference


def product_f32(t, s, *, kind, row=WHOLE):  # the seventh session's best
    if kind != "softmax":
        return ORIGINAL(t, s, kind=kind, row=row)
    f = compute_dtype(t.dtype)
    total = row.sum((s * t).astype(f))
    return ((s.astype(f) * (t.astype(f) - total)).astype(t.dtype),)


def diamond(f32, barrier):
    """p = y * t; p - y * sum(p): the reduce's input reused by its consumer."""

    def derivative(t, s, *, kind, row=WHOLE):
        if kind != "softmax":
            return ORIGINAL(t, s, kind=kind, row=row)
        y = jax.lax.optimization_barrier(s) if barrier else s
        f = compute_dtype(t.dtype) if f32 else t.dtype
        y, t_ = y.astype(f), t.astype(f)
        p = y * t_
        return ((p - y * row.sum(p)).astype(t.dtype),)

    return derivative


VARIANTS = {
    "product_f32": product_f32,
    "diamond_f32_barrier": diamond(True, True),
    "diamond_f32": diamond(True, False),
    "diamond_in_dtype_barrier": diamond(False, True),
    "diamond_in_dtype": diamond(False, False),
}


@contextlib.contextmanager
def derivative(variant, on_xla):
    sm._derivative.reference = VARIANTS[variant]
    if on_xla:
        _primitive.REFERENCE_FASTER["quack_jax_softmax_derivative"] = lambda *a, **k: True
    try:
        yield
    finally:
        sm._derivative.reference = ORIGINAL
        _primitive.REFERENCE_FASTER.pop("quack_jax_softmax_derivative", None)


# name: (function, lowering path, variant, derivative on XLA in the default path)
FNS = {
    "xla": (jax.nn.softmax, "auto", "product_f32", False),
    "auto": (quack_jax.softmax, "auto", "product_f32", False),
}
for v in VARIANTS:
    FNS[f"auto_dref_{v}"] = (quack_jax.softmax, "auto", v, True)
K = 32


def kernels_of(text):
    entry = text[text.index("ENTRY") :]
    return len(re.findall(r"= \S+ fusion\(", entry)), len(re.findall(r"custom-call\(", entry))


# errors of each variant's derivative against float64 (reference path), 64 x 4096
key = jax.random.key(0)
x = (3 * jax.random.normal(key, (64, 4096), jnp.float32)).astype(jnp.bfloat16)
dy = jax.random.normal(jax.random.key(1), (64, 4096), jnp.float32).astype(jnp.bfloat16)
x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
e = np.exp(x64 - x64.max(-1, keepdims=True))
y64 = e / e.sum(-1, keepdims=True)
g64 = y64 * (dy64 - (dy64 * y64).sum(-1, keepdims=True))
errors = {}
for v in VARIANTS:
    with derivative(v, False), lowering_path("reference"):
        _, g = jax.jit(fwd_bwd(quack_jax.softmax))(x, dy)
    g = np.asarray(g[0], np.float64)
    errors[v] = float(np.max(np.abs(g - g64)) / np.max(np.abs(g64)))
print(json.dumps({"max_error_over_max_grad": errors}), flush=True)
(out / "errors.json").write_text(json.dumps(errors, indent=1))

results = []
for m, n in bench.benchmarks()["softmax"].latency_shapes:
    progs, names = [], []
    structs = [(jax.ShapeDtypeStruct((m, n), jnp.bfloat16),) * 2] * K
    for name, (fn, path, v, on_xla) in FNS.items():
        with lowering_path(path), derivative(v, on_xla):
            compiled = bench.lower_calls(fwd_bwd(fn), structs, chain=True).compile()
        text = compiled.as_text()
        if (m, n) == (64, 8192):
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
    (out / "softmax_variants.json").write_text(json.dumps(results, indent=1))
