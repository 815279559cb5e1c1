"""The packaged norm kernels against quack_jax's XLA reference in float64, on the wheel.

    python pkg_check.py PART PARTS   # this process's share of the functions

Each function of the norms' packaged lowerings (``OpSpec.lowerings(..., packaged=True)``:
forward and ``jax.vjp``; every packaged row length in float32, 64, 1024, 4096 and 8192
in the 16-bit dtypes) runs on 1003 rows with the kernels forced, and again on the
reference in float64. Inputs are multiples of 1/8 up to 4, so that x + residual is exact
in every dtype: the kernels round h to x's dtype, as the op defines, and a float64
reference does not. Run by ``wheel_check.sh`` with only the wheel installed.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from quack_jax import _cache, _registry
from quack_jax._primitive import lowering_path
from quack_jax.build import packaged_sizes

part, parts = int(sys.argv[1]), int(sys.argv[2])
specs = _registry.specs()
jobs = []
for op in ("rms_norm", "layer_norm"):
    for dtype in ("float32", "bfloat16", "float16"):
        for n in packaged_sizes(specs[op]):
            if dtype == "float32" or n in (64, 1024, 4096, 8192):
                jobs += [
                    (op, dtype, n, fn, args) for fn, args in specs[op].lowerings(op, dtype, n, True)
                ]
bad = kernels = 0
worst = {}
for i, (op, dtype, n, fn, args) in enumerate(jobs):
    if i % parts != part:
        continue
    key = jax.random.key(i)

    def draw(s):
        global key
        key, k = jax.random.split(key)
        shape = (1003, *s.shape[1:]) if len(s.shape) == 2 else s.shape
        # multiples of 1/8 up to 4: x + residual is exact in every dtype (h's rounding)
        return (jnp.clip(jnp.round(jax.random.normal(k, shape) * 8), -32, 32) / 8).astype(s.dtype)

    inputs = jax.tree.map(draw, args)
    with lowering_path("kernel"), _cache.kernels_used() as used:
        outs = [jax.jit(fn)(*inputs)]
    kernels += len(used)
    assert used, (op, dtype, n)
    with jax.enable_x64(True), lowering_path("reference"):
        wide = jax.tree.map(lambda x: np.asarray(x, np.float64), inputs)
        outs.append(jax.jit(fn)(*wide))
    tol = 1e-4 if dtype == "float32" else 2e-2
    for got, want in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        err = np.max(np.abs(got - want) / (1 + np.abs(want))) if got.size else 0.0
        if not np.isfinite(got).all() or err > tol:
            bad += 1
            print(f"MISMATCH {op} {dtype} n={n} shape={got.shape} err={err}", flush=True)
        worst[dtype, got.ndim] = max(worst.get((dtype, got.ndim), 0.0), float(err))
print(
    f"part {part}: {sum(1 for i in range(len(jobs)) if i % parts == part)} functions, "
    f"{kernels} kernel launches lowered, {bad} mismatches; worst {worst}",
    flush=True,
)
