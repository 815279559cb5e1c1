"""Norm fwd+bwd at small shapes on the change of call 3: the backward's reference with
rstd outside its row sum (so that XLA computes that sum in one pass with the forward's),
and the pair rule (``_primitive.norm_pair_on_xla``). Ways: kernel (both kernels, as main
lowered these shapes before), reference (both primitives on XLA), auto (the rule), xla
(XLA's own autodiff of the plain formulation). Chains of K = 32 fwd+bwd ops, SAMPLES
samples alternating. Writes OUT/norm_pair.json, and OUT/hlo/<op>_<m>x<n>_<way>.txt, each
way's optimised HLO at the shapes of HLO_SHAPES.
"""

import concurrent.futures
import contextlib
import json
import os
import re
import sys

import jax

from quack_jax import _primitive, bench
from quack_jax._spec import Benchmark

OUT = sys.argv[1]
SAMPLES = int(sys.argv[2])
SHAPES = {
    "rms_norm": [(m, n) for n in (2048, 4096, 8192) for m in (8, 64, 128, 256, 512)],
    "layer_norm": [(m, n) for n in (2048, 8192) for m in (8, 64, 128, 256, 512)],
}
HLO_SHAPES = {("rms_norm", 64, 8192), ("layer_norm", 64, 8192)}
K = 32
WAYS = {
    "kernel": lambda: _primitive.lowering_path("kernel"),
    "reference": lambda: _primitive.lowering_path("reference"),
    "auto": lambda: contextlib.nullcontext(),
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
        with open(f"{OUT}/norm_pair.json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
