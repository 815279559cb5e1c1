"""Norm fwd+bwd at small shapes: does XLA's path match XLA's own autodiff once the
backward recomputes the row statistics from h instead of reading the forward's?

Each norm (bfloat16 x, float32 weight and bias, as `bench --latency`) as a chain of K = 32
fwd+bwd ops in one jit, lowered these ways and timed together, samples alternating
(`quack_jax.bench.time_compiled`), SAMPLES times per shape:
  auto       main's default: forward kernel (under autodiff), backward kernel;
  reference  both primitives on their XLA references (lowering_path("reference"));
  recompute  as reference, but the backward's reference recomputes rstd (and the mean)
             from h with the bench's eps, so the forward's statistics are dead code;
  fk_recomp  the forward kernel, the backward on the recomputing reference;
  xla        XLA's own autodiff of the plain jnp formulation (the bench's XLA column).
The recomputing reference is this experiment's, patched in around the lowering.
Also counts, per op, the fusions and custom calls of each compiled program.
Writes OUT/norm_recompute.json and prints XLA's time over each way's per shape.
"""

import concurrent.futures
import contextlib
import json
import os
import re
import sys

import jax
from jax import lax

from quack_jax import _cache, _primitive, bench, norm
from quack_jax._partition import WHOLE
from quack_jax._spec import Benchmark

OUT = sys.argv[1]
SAMPLES = int(sys.argv[2])
ROWS = (1, 8, 64, 128, 256, 512, 1024, 2048)
NS = (1024, 2048, 4096, 8192)
K = 32
EPS = 1e-6  # norm._benchmark's
ORIGINAL = norm._reference_backward


def recomputing(dy, h, *rest, rms, row=WHOLE, **params):
    stats = 1 if rms else 2
    ct = rest[-1].dtype
    h32 = h.astype(ct)
    mean = None if rms else row.mean(h32)
    centred = h32 if rms else h32 - mean
    rstd = lax.rsqrt(row.mean(centred * centred) + EPS)[..., 0]
    fresh = [rstd] + ([] if rms else [mean[..., 0]])
    return ORIGINAL(dy, h, *rest[: len(rest) - stats], *fresh, rms=rms, row=row, **params)


@contextlib.contextmanager
def patched():
    norm._backward.reference = recomputing
    try:
        yield
    finally:
        norm._backward.reference = ORIGINAL


@contextlib.contextmanager
def rule(name, taken):
    old = _primitive.REFERENCE_FASTER.get(name)
    _primitive.REFERENCE_FASTER[name] = lambda *a, **k: taken
    try:
        yield
    finally:
        _primitive.REFERENCE_FASTER[name] = old


@contextlib.contextmanager
def both(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


WAYS = {
    "auto": lambda: contextlib.nullcontext(),
    "reference": lambda: _primitive.lowering_path("reference"),
    "recompute": lambda: both(_primitive.lowering_path("reference"), patched()),
    "fk_recomp": lambda: both(rule("quack_jax_norm_backward", True), patched()),
}
LAUNCH = re.compile(r"= [^=]*\b(fusion|custom-call)\(")


def launches(compiled) -> float:
    return len(LAUNCH.findall(compiled.as_text())) / K


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
                        try:
                            with context():
                                lowered = bench.lower_calls(
                                    cases["quack_fwd_bwd"].fn, [structs] * K, chain=True
                                )
                        except _cache.MissingKernelError as error:
                            print(f"{name} {m}x{n} {way}: {error}", flush=True)
                            continue
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
        row |= {f"{w}_launches": launches(c) for w, c in compiled.items()}
        for _ in range(SAMPLES):
            seconds = bench.time_compiled(
                [(c, args) for c in compiled.values()], 15, bench.LATENCY_WARMUP
            )
            for w, s in zip(compiled, seconds, strict=True):
                row.setdefault(w, []).append(s * 1e6)
        rows.append(row)
        xla = sum(row["xla"])
        ratios = "  ".join(f"{w} {xla / sum(row[w]):.3f}" for w in WAYS if w in row)
        counts = " ".join(f"{row[f'{w}_launches']:g}" for w in compiled)
        print(f"{op.name} {m}x{n}: xla {xla / SAMPLES:.2f} µs  {ratios}  [{counts}]", flush=True)
        programs.clear()
        del compiled, args
        with open(f"{OUT}/norm_recompute.json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
