"""Device experiment (issue 17, seventh session): formulations of softmax's reference
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


def f32_plain(t, s, *, kind, row=WHOLE):  # main's: float32 math on y as saved
    return ORIGINAL(t, s, kind=kind, row=row)


def f32_barrier(t, s, *, kind, row=WHOLE):  # the branch's
    if kind != "softmax":
        return ORIGINAL(t, s, kind=kind, row=row)
    t32 = t.astype(compute_dtype(t.dtype))
    y = jax.lax.optimization_barrier(s).astype(t32.dtype)
    return ((y * (t32 - row.sum(t32 * y))).astype(t.dtype),)


def in_dtype(t, s, *, kind, row=WHOLE):  # jax.nn.softmax's jvp: in the input dtype
    if kind != "softmax":
        return ORIGINAL(t, s, kind=kind, row=row)
    return (s * (t - row.sum(s * t)),)


def in_dtype_barrier(t, s, *, kind, row=WHOLE):
    if kind != "softmax":
        return ORIGINAL(t, s, kind=kind, row=row)
    y = jax.lax.optimization_barrier(s)
    return (y * (t - row.sum(y * t)),)


def product_f32(t, s, *, kind, row=WHOLE):  # products in the dtype, sum and rest float32
    if kind != "softmax":
        return ORIGINAL(t, s, kind=kind, row=row)
    f = compute_dtype(t.dtype)
    total = row.sum((s * t).astype(f))
    return ((s.astype(f) * (t.astype(f) - total)).astype(t.dtype),)


VARIANTS = {
    "f32_plain": f32_plain,
    "f32_barrier": f32_barrier,
    "in_dtype": in_dtype,
    "in_dtype_barrier": in_dtype_barrier,
    "product_f32": product_f32,
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
    "xla": (jax.nn.softmax, "auto", "f32_plain", False),
    "auto": (quack_jax.softmax, "auto", "f32_plain", False),
}
for v in VARIANTS:
    FNS[f"ref_{v}"] = (quack_jax.softmax, "reference", v, False)
FNS["auto_dref_in_dtype"] = (quack_jax.softmax, "auto", "in_dtype", True)
FNS["auto_dref_product_f32"] = (quack_jax.softmax, "auto", "product_f32", True)
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
