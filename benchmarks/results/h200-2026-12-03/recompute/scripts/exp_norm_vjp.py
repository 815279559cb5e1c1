"""Norm fwd+bwd at small shapes, second look: the backward's XLA reference written as
JAX's VJP of the forward reference (the statistics recomputed from h with the bench's
eps), so that on XLA's path XLA sees the graph of its own autodiff of the plain
formulation. Ways (see exp_norm_recompute.py): auto, reference, vjp (both primitives on
XLA, the backward by VJP), xla. Chains of K = 32 fwd+bwd ops, SAMPLES samples
alternating. Writes OUT/norm_vjp.json, and OUT/hlo/<op>_<m>x<n>_<way>.txt, each way's
optimised HLO at the shapes of HLO_SHAPES.
"""

import concurrent.futures
import contextlib
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

from quack_jax import _primitive, bench, norm
from quack_jax._partition import WHOLE
from quack_jax._spec import Benchmark

OUT = sys.argv[1]
SAMPLES = int(sys.argv[2])
SHAPES = {
    "rms_norm": [(m, n) for n in (4096, 8192) for m in (8, 64, 128, 256, 512)],
    "layer_norm": [(m, n) for n in (2048, 8192) for m in (64, 128, 256, 512)],
}
HLO_SHAPES = {("rms_norm", 64, 8192), ("rms_norm", 8, 8192), ("layer_norm", 64, 8192)}
K = 32
EPS = 1e-6  # norm._benchmark's
ORIGINAL = norm._reference_backward


def by_vjp(dy, h, *rest, rms, offset, weight, dh, weight_grad, bias_grad, row=WHOLE):
    w, dh_, *_ = norm._split(rest, weight, dh)
    ct = jnp.float32
    b = jnp.zeros(h.shape[-1], ct) if bias_grad else None

    def f(h, *params):
        w_, b_ = norm._split(params, weight, bias_grad)
        operands = [a for a in (h, w_, b_) if a is not None]
        return norm._reference_forward(
            *operands,
            rms=rms,
            eps=EPS,
            offset=offset,
            out_dtype=dy.dtype.name,
            residual=False,
            weight=weight,
            bias=bias_grad,
            differentiated=False,
            row=row,
        )[0]

    params = [a for a in (w, b) if a is not None]
    _, vjp = jax.vjp(f, h, *params)
    dx, *grads = vjp(dy)
    if dh_ is not None:
        dx = (dx.astype(ct) + dh_.astype(ct)).astype(h.dtype)
    grads = [g.astype(ct) for g in grads]
    return [dx, *grads]  # the weight and bias gradients are those asked for


@contextlib.contextmanager
def patched():
    norm._backward.reference = by_vjp
    try:
        yield
    finally:
        norm._backward.reference = ORIGINAL


@contextlib.contextmanager
def both(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


WAYS = {
    "auto": lambda: contextlib.nullcontext(),
    "reference": lambda: _primitive.lowering_path("reference"),
    "vjp": lambda: both(_primitive.lowering_path("reference"), patched()),
}
LAUNCH = re.compile(r"= [^=]*\b(fusion|custom-call)\(")


def main():
    os.makedirs(f"{OUT}/hlo", exist_ok=True)
    ops = bench.benchmarks()
    shapes = []
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        for name, sizes in SHAPES.items():
            op: Benchmark = ops[name]
            cases = {c.key: c for c in op.cases}
            for m, n in sizes:
                structs = tuple(
                    jax.ShapeDtypeStruct(s, d) for s, d, *_ in op.arguments(m, n, "bfloat16")
                )
                programs = {}
                for way, context in WAYS.items():
                    with context():
                        lowered = bench.lower_calls(
                            cases["quack_fwd_bwd"].fn, [structs] * K, chain=True
                        )
                    programs[way] = pool.submit(lowered.compile)
                lowered = bench.lower_calls(cases["xla_fwd_bwd"].fn, [structs] * K, chain=True)
                programs["xla"] = pool.submit(lowered.compile)
                shapes.append((op, m, n, programs))
    print("lowered", flush=True)
    rows = []
    for op, m, n, programs in shapes:
        compiled = {w: c.result() for w, c in programs.items()}
        if (op.name, m, n) in HLO_SHAPES:
            for w, c in compiled.items():
                with open(f"{OUT}/hlo/{op.name}_{m}x{n}_{w}.txt", "w") as f:
                    f.write(c.as_text())
        args = bench.make_inputs(op.arguments(m, n, "bfloat16"), K, seed=m * n)
        row = {"op": op.name, "m": m, "n": n}
        row |= {f"{w}_launches": len(LAUNCH.findall(c.as_text())) / K for w, c in compiled.items()}
        for _ in range(SAMPLES):
            seconds = bench.time_compiled(
                [(c, args) for c in compiled.values()], 15, bench.LATENCY_WARMUP
            )
            for w, s in zip(compiled, seconds, strict=True):
                row.setdefault(w, []).append(s * 1e6)
        rows.append(row)
        xla = sum(row["xla"])
        ratios = "  ".join(f"{w} {xla / sum(row[w]):.3f}" for w in WAYS)
        counts = " ".join(f"{row[f'{w}_launches']:g}" for w in compiled)
        print(f"{op.name} {m}x{n}: xla {xla / SAMPLES:.2f} µs  {ratios}  [{counts}]", flush=True)
        programs.clear()
        del compiled, args
        with open(f"{OUT}/norm_vjp.json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
