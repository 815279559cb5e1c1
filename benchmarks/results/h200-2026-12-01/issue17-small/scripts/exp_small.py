"""Device experiment (issue 17, 2026-12-01): softmax fwd+bwd at small shapes, and the CE
kernels of half a vocabulary on one GPU."""

import importlib
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import quack_jax
from quack_jax import _cache, bench
from quack_jax._primitive import lowering_path
from quack_jax._spec import fwd_bwd

sm = importlib.import_module("quack_jax.softmax")

out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
f32 = jnp.float32
FNS = {
    "xla": (jax.nn.softmax, "auto"),
    "xla_f32": (lambda x: jax.nn.softmax(x.astype(f32)).astype(x.dtype), "auto"),
    "ref_jnp": (lambda x: sm._reference_forward(x, log=False)[0], "auto"),
    "quack_auto": (quack_jax.softmax, "auto"),
    "quack_ref": (quack_jax.softmax, "reference"),
    "quack_kernel": (quack_jax.softmax, "kernel"),
}
SHAPES = [
    (1, 1024),
    (8, 1024),
    (512, 1024),
    (1, 4096),
    (8, 4096),
    (64, 4096),
    (512, 4096),
    (1, 8192),
    (64, 8192),
    (4096, 4096),
]
K = 32
results = []


def kernels_of(text):
    entry = text[text.index("ENTRY") :]
    fus = len(re.findall(r"= \S+ fusion\(", entry))
    cc = len(re.findall(r"custom-call\(", entry))
    return fus, cc


for m, n in SHAPES:
    progs, names = [], []
    structs = [(jax.ShapeDtypeStruct((m, n), jnp.bfloat16),) * 2] * K
    for name, (fn, path) in FNS.items():
        with lowering_path(path):
            lowered = bench.lower_calls(fwd_bwd(fn), structs, chain=True)
        compiled = lowered.compile()
        text = compiled.as_text()
        if (m, n) == (8, 4096):
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
(out / "softmax_small.json").write_text(json.dumps(results, indent=1))

# cross-entropy of half a vocabulary (register tilings) on one GPU, against float64
ce_rows = []
for m, v in [(1000, 64128), (1000, 128000), (1, 64128), (1, 128000)]:
    key = jax.random.key(v + m)
    kx, kl = jax.random.split(key)
    x = (3 * jax.random.normal(kx, (m, v), f32)).astype(jnp.bfloat16)
    labels = jax.random.randint(kl, (m,), 0, v).at[::7].set(-100)

    def loss(x, labels):
        return jnp.sum(quack_jax.cross_entropy(x, labels, reduction="none"))

    with _cache.kernels_used() as used, lowering_path("kernel"):
        f = jax.jit(jax.value_and_grad(loss)).lower(x, labels).compile()
        per = (
            jax.jit(lambda x, labels: quack_jax.cross_entropy(x, labels, reduction="none"))
            .lower(x, labels)
            .compile()
        )
    value, grad = f(x, labels)
    rows = np.asarray(per(x, labels), np.float64)
    x64 = np.asarray(x, np.float64)
    lab = np.asarray(labels)
    top = x64.max(-1, keepdims=True)
    e = np.exp(x64 - top)
    s = e.sum(-1, keepdims=True)
    p = e / s
    lse = (top + np.log(s))[:, 0]
    valid = lab >= 0
    ref_rows = np.where(valid, lse - x64[np.arange(m), np.where(valid, lab, 0)], 0.0)
    hit = (np.arange(v)[None] == lab[:, None]) & valid[:, None]
    ref_grad = np.where(valid[:, None], p - hit, 0.0)
    g = np.asarray(grad, np.float64)
    err_rows = float(np.max(np.abs(rows - ref_rows) / (1 + np.abs(ref_rows))))
    err_grad = float(np.max(np.abs(g - ref_grad)))
    err_sum = float(abs(float(value) - ref_rows.sum()) / (1 + abs(ref_rows.sum())))
    r = {
        "m": m,
        "v": v,
        "kernels": [f"{o} {d} {t.tag}" for o, d, t, _ in used],
        "err_rows": err_rows,
        "err_grad": err_grad,
        "err_sum": err_sum,
        "finite": bool(np.isfinite(g).all() and np.isfinite(rows).all()),
    }
    print(json.dumps(r), flush=True)
    ce_rows.append(r)
(out / "ce_half_vocab.json").write_text(json.dumps(ce_rows, indent=1))
