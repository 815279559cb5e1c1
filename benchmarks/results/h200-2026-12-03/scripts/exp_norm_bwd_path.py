"""Norm fwd+bwd at small shapes: which primitive's path makes up the gap to XLA?

Each norm (bfloat16 x, float32 weight and bias, as `bench --latency`) as a chain of K = 32
fwd+bwd ops in one jit, lowered five ways and timed together, samples alternating
(`quack_jax.bench.time_compiled`), twice per shape:
  auto      main's default: forward kernel (under autodiff), backward kernel;
  bwd_xla   the forward kernel, the backward primitive on its XLA reference;
  fwd_xla   the forward primitive on its XLA reference, the backward kernel;
  reference both primitives on their XLA references (lowering_path("reference"));
  xla       XLA's own autodiff of the plain jnp formulation (the bench's XLA column).
Writes OUT/norm_bwd_path.json and prints a table of XLA's time over each way's.
"""

import concurrent.futures
import contextlib
import json
import os
import sys

import jax

from quack_jax import _primitive, bench
from quack_jax._spec import Benchmark

OUT = sys.argv[1]
ROWS = (1, 8, 64, 128, 256, 512, 1024, 4096)
NS = (1024, 2048, 4096, 8192)
K = 32


@contextlib.contextmanager
def rule(name, taken):
    old = _primitive.REFERENCE_FASTER.get(name)
    _primitive.REFERENCE_FASTER[name] = lambda *a, **k: taken
    try:
        yield
    finally:
        _primitive.REFERENCE_FASTER[name] = old


WAYS = {
    "auto": lambda: contextlib.nullcontext(),
    "bwd_xla": lambda: rule("quack_jax_norm_backward", True),
    "fwd_xla": lambda: rule("quack_jax_norm", True),
    "reference": lambda: _primitive.lowering_path("reference"),
}


def main():
    ops = bench.benchmarks()
    shapes = []  # (op, m, n, {way: compiling})
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        for name in ("rms_norm", "layer_norm"):
            op: Benchmark = ops[name]
            cases = {c.key: c for c in op.cases}
            for n in NS:
                for m in ROWS:
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
        args = bench.make_inputs(op.arguments(m, n, "bfloat16"), K, seed=m * n)
        row = {"op": op.name, "m": m, "n": n}
        for sample in (1, 2):
            seconds = bench.time_compiled(
                [(c, args) for c in compiled.values()], 15, bench.LATENCY_WARMUP
            )
            for w, s in zip(compiled, seconds, strict=True):
                row[f"{w}_{sample}"] = s * 1e6
        rows.append(row)
        xla = row["xla_1"] + row["xla_2"]
        ratios = "  ".join(f"{w} {xla / (row[f'{w}_1'] + row[f'{w}_2']):.3f}" for w in WAYS)
        print(
            f"{op.name} {m}x{n}: xla {row['xla_1']:.2f}/{row['xla_2']:.2f} µs  {ratios}", flush=True
        )
        programs.clear()
        del compiled, args
        with open(f"{OUT}/norm_bwd_path.json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
