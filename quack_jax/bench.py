"""quack_jax against XLA (and Flax, for the norms), side by side in one process: each op's
forward, and forward plus backward (jax.vjp), on the shapes of the project's anchors.

    python -m quack_jax.bench                  # every op's table on this machine's default device
    python -m quack_jax.bench --quick          # small shapes, under a minute on a 2-core CPU
    python -m quack_jax.bench --ops rms_norm --tune --out DIR  # and every candidate tiling (GPU)
    python -m quack_jax.bench --latency        # microseconds per op at small and decode shapes

Ops (--ops): the benchmarks each op family declares in its SPEC (softmax, rms_norm,
layer_norm, cross_entropy, token_logprobs); each writes <op>.md, <op>.json and, with matplotlib
installed, <op>.png to --out. Without a GPU that runs quack_jax's kernels, quack_jax runs
its XLA fallback: the tables then compare XLA with XLA and show no speedups, and the full
shapes, sized for a GPU, take about two hours on a 2-core CPU.

Timing: one jitted function applies the op to K distinct inputs (no common subexpressions,
no L2 reuse), K chosen so one call moves about 10 GB (10 with --quick; 1 where quack_jax
runs its XLA fallback); after a warm-up, each sample is three back-to-back calls (so host
dispatch overlaps the GPU's work), and the result is the median of the samples divided by
3 K (why: docs/decisions/021-benchmark-timing.md). The quack_jax functions are lowered to
their kernels at every shape (also where the default lowering picks XLA's path: see
--latency). The references are timed the same way on the same inputs: XLA's
jax.nn.softmax; for the norms a plain jnp formulation
(float32 math, rsqrt, LayerNorm with the centred variance, cast back to x's dtype) and
Flax's nn.RMSNorm / nn.LayerNorm (dtype x's, float32 params, the same epsilon, applied
with the same weight and bias). So is the ceiling: x * 2 over float32 arrays of the same
byte size. TB/s counts the bytes the op must move at least, e being x's element size:

- softmax: forward 2*M*N*e (read x, write y); forward+backward, jax.vjp that also
  returns y (as in training, where y is used), 5*M*N*e (the forward reads x and writes y,
  the backward reads x or y and dy and writes dx).
- cross_entropy, labels uniform in [0, N), reduction "mean": forward M*N*e (read the
  logits); forward+backward, jax.grad of the mean loss w.r.t. the logits, 2*M*N*e
  (read the logits, write their gradient: quack_jax's one forward kernel that also writes
  the gradient moves exactly that). XLA is optax's formulation in float32.
- token_logprobs with the entropy at temperature 0.7, labels uniform in [0, N): forward
  M*N*e (read the logits); forward+backward, jax.vjp with cotangents for logp and the
  entropy, 3*M*N*e (the forward's read, the backward's read and write). XLA is
  log_softmax of logits / T in float32, a gather and -sum(p * logp); beside it,
  cross_entropy's per-row losses at the same temperature (the same passes).
- rms_norm, layer_norm, with a float32 weight (and bias) of shape (N,) and y in x's dtype:
  forward 2*M*N*e; forward+backward, jax.vjp w.r.t. x, weight and bias that also
  returns y, 5*M*N*e (the forward reads x and writes y, the backward reads x and dy and
  writes dx; the weight and bias bytes are negligible).

--tune times every candidate tiling of each kernel alone: the forward op, the backward
kernel by itself (softmax's derivative; the norms' and cross-entropy's backward
primitives with the saved statistics precomputed), cross-entropy's forward that also
writes the gradient, and token_logprobs' forward and backward with the entropy; the
cross-entropy kernels' candidates include streamed tilings. The persistent norm kernels'
candidates run on one wave of clusters; the norm forward's also on one CTA per row block
(tag +full-grid), where it loads its rows straight into registers, so that its
candidates there need not fit the staged rows' shared memory. The first candidate (the
tuning table's "default") is the tiling that kernel launches at the shape, as in the
tilings column.

--latency times each op at small and decode shapes (each op's latency_shapes: M from 1
to 4096 rows at the family's row lengths, and QK-norm's rows for rms_norm), in bfloat16
unless --dtypes says otherwise, and reports microseconds per op, to <op>_latency.md and
<op>_latency.json. Each quack_jax function is timed three ways: as lowered by default
(kernels, except at the small shapes that lower to XLA's formulation, see
docs/decisions/004-small-shape-xla-rules.md), with the kernels forced
(lowering_path("kernel")) and with quack_jax's XLA reference forced
(lowering_path("reference")); XLA's function beside them. One jitted function applies
the op to K = 32 distinct inputs (fewer where they would not fit the memory budget; 2
where quack_jax runs its XLA fallback) in a chain, as the layers of a decode step: op k's
arguments pass through jax.lax.optimization_barrier together with op k-1's result, so
op k cannot start before op k-1 ends and XLA cannot fuse the K ops horizontally or run
them concurrently. An op's functions are all lowered first, and XLA compiles them in
parallel threads; then each shape's programs are timed together: after 50 ms of calls,
15 samples of each (three back-to-back calls), the programs' samples alternating so that a
drift affects them alike; the time per op is a program's median sample divided by 3 K.
Functions that lower to the same program (on the fallback, every path) are timed once.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import hashlib
import importlib.util
import json
import math
import os
import pathlib
import sys

import jax

from quack_jax import _cache, _registry, _timing
from quack_jax._lowering import lowering, lowering_path
from quack_jax._primitive import REFERENCE_FASTER
from quack_jax._report import (
    LATENCY_NOTE,
    LATENCY_PASSES,
    SPEEDUP_NOTE,
    latency_columns,
    plot,
    table,
    tbps,
    tuning_table,
)
from quack_jax._spec import Benchmark, Case, Tuned
from quack_jax._tiling import ITEMSIZE, RowTiling
from quack_jax.build import lower_for_cuda

DTYPES = ["bfloat16", "float32"]
TARGET_BYTES = 10e9
TUNE_BYTES = 2e9  # tuning ranks candidates, so it can afford a larger dispatch share
MEMORY_BUDGET = 60e9
LATENCY_INPUTS = 32  # ops per timed call with --latency
LATENCY_WARMUP = 0.05  # seconds of calls before a shape's --latency timings (clocks up)
LATENCY_REPS = 15  # --latency's default samples: a few microseconds per op are noisy
LATENCY_QUICK_ROWS = (1, 64)  # --latency --quick: these rows at the op's first row length
# the quack_jax functions' lowerings (see ``lowering_path``), by the suffix of their entry
LATENCY_PATHS = {"kernel": "_kernel", "reference": "_reference", "auto": ""}


def benchmarks() -> dict[str, Benchmark]:
    """Each op family's benchmarks (its ``SPEC.benchmarks``), by name."""
    return {
        benchmark.name: benchmark
        for spec in _registry.families()
        for benchmark in (spec.benchmarks() if spec.benchmarks else ())
    }


def input_count(op: Benchmark, size: int, quick: bool = False, latency: bool = False) -> int:
    """How many distinct inputs of ``size`` bytes (an (M, N) array) one timed call takes:
    about TARGET_BYTES moved, within the memory budget; 10 for ``quick``; LATENCY_INPUTS
    for ``latency``, within the budget; 1 where quack_jax runs its XLA fallback (no kernel
    launches to amortise, and XLA against XLA needs no more than a smoke test's accuracy),
    2 for ``latency`` (a chain)."""
    if not _timing.kernel_device():
        return 2 if latency else 1
    most = MEMORY_BUDGET // (op.footprint * size)
    if latency:
        return int(max(1, min(LATENCY_INPUTS, most)))
    if quick:
        return 10
    return int(min(max(10, math.ceil(TARGET_BYTES / (2 * size))), most))


def tune_tiling(t: Tuned, shape, tiling, tag, one_wave, inputs, reps, results):
    """Times ``t``'s kernel alone with ``tiling`` (on one wave, or with ``one_wave``
    false on one CTA per row block) into ``results[tag]``, and prints the rate; a
    candidate that fails to launch (e.g. too much shared memory) is printed and skipped."""
    dtype, m, n = shape
    size = m * n * ITEMSIZE[dtype]
    try:
        with lowering(tilings={(t.family, n, ITEMSIZE[dtype]): tiling}, one_wave=one_wave):
            results[tag] = _timing.time_per_call(t.fn, inputs, reps, require_kernel=True)
    except RuntimeError as error:  # at lowering (the occupancy query) or at run time
        print(f"tune {dtype} {m}x{n} {t.name} {tag} failed: {error}"[:300], flush=True)
        return
    rate = tbps(t.passes * size, results[tag])
    print(f"tune {dtype} {m}x{n} {t.name} {tag} {rate:.3f} TB/s", flush=True)


def launched_tiling(t: Tuned, arguments) -> RowTiling | None:
    """The tiling of the kernel that ``t``'s function launches on the shapes of
    ``arguments`` (one tuple of the op's inputs), lowered for CUDA: None where it
    launches none (no kernel device, or no cubin for it). Each tuned kernel's own, where
    several share an op name (cross-entropy's forwards with and without the gradient)."""
    operands = jax.eval_shape(t.prepare, *arguments)
    try:
        with _cache.kernels_used() as used:
            lower_for_cuda(t.fn, operands)
    except _cache.MissingKernelError:
        return None
    return next((tiling for _, _, tiling, _ in used), None)


def bench_shape(op: Benchmark, m, n, dtype, reps, tune, quick):
    e = ITEMSIZE[dtype]
    size = m * n * e
    count = input_count(op, size, quick)
    on_gpu = _timing.kernel_device()
    row = {"dtype": dtype, "m": m, "n": n, "k": count}
    words = _timing.make_inputs([((m, n * e // 4), "float32")], count, seed=m)
    row["copy"] = _timing.time_per_call(lambda x: x * 2, words, reps)
    del words
    arguments = _timing.make_inputs(op.arguments(m, n, dtype), count, seed=m * n)
    for case in op.cases:
        inputs = [a[: case.args] for a in arguments]
        # the kernels at every shape, also where the default lowering picks XLA's path
        path = lowering_path("kernel") if case.kernel else contextlib.nullcontext()
        try:
            with path:
                row[case.key] = _timing.time_per_call(case.fn, inputs, reps, case.kernel and on_gpu)
        except _cache.MissingKernelError as error:  # not packaged, and no CuTe-DSL here
            row[case.key] = None
            print(f"  {case.label} {dtype} {m}x{n} not timed: {error}", flush=True)
    # the tiling each tuned kernel launches here (the tables' column, the tuner's default)
    tilings = {t.name: launched_tiling(t, arguments[0]) if on_gpu else None for t in op.tuned}
    for t in op.tuned:
        row[f"tiling_{t.name}"] = tilings[t.name].tag if tilings[t.name] else "-"
    if tune:
        k = max(10, math.ceil(TUNE_BYTES / (2 * size)))
        for t in op.tuned:
            prepare = jax.jit(t.prepare)
            inputs = [prepare(*a) for a in arguments[:k]]
            results = row[f"tune_{t.name}"] = {}
            for tag, tiling, one_wave in t.runs(n, e, tilings[t.name]):
                tune_tiling(t, (dtype, m, n), tiling, tag, one_wave, inputs, reps, results)
            del inputs
    del arguments
    return row


def latency_shapes(op: Benchmark, quick: bool) -> list[tuple[int, int]]:
    """The op's --latency shapes; with ``quick``, LATENCY_QUICK_ROWS at its first row length."""
    if quick and op.latency_shapes:
        return [(m, op.latency_shapes[0][1]) for m in LATENCY_QUICK_ROWS]
    return op.latency_shapes


def latency_cases(op: Benchmark) -> list[Case]:
    """The quack_jax and XLA functions of each of LATENCY_PASSES that the op has."""
    keys = {f"{who}_{p}" for p in LATENCY_PASSES for who in ("quack", "xla")}
    return [case for case in op.cases if case.key in keys]


def bench_latency(op: Benchmark, shapes, reps) -> list[dict]:
    """A row per (dtype, m, n) of ``shapes``: seconds per op of the op's quack_jax
    functions on each of LATENCY_PATHS (the entry ``<key><suffix>``) and of its XLA
    functions, each a chain of K ops. Every function is lowered first, one by one (the
    path is read then), each distinct program compiled in a thread as it comes (XLA
    compiles in parallel); then each shape's programs are timed, their samples alternating.
    """
    on_gpu = _timing.kernel_device()
    rows, programs = [], []  # per shape, by text: [compiled, args, keys, must launch kernels]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        for i, (dtype, m, n) in enumerate(shapes, 1):
            progress = f"  {op.name} {dtype} {m}x{n} ({i} of {len(shapes)})"
            print(f"{progress}: lowering", file=sys.stderr, flush=True)
            count = input_count(op, m * n * ITEMSIZE[dtype], latency=True)
            rows.append(row := {"dtype": dtype, "m": m, "n": n, "k": count})
            structs = tuple(jax.ShapeDtypeStruct(s, d) for s, d, *_ in op.arguments(m, n, dtype))
            programs.append(shape_programs := {})
            for case in latency_cases(op):
                inputs = [structs[: case.args]] * count
                for path, suffix in LATENCY_PATHS.items() if case.kernel else [("auto", "")]:
                    row[case.key + suffix] = None
                    try:
                        with lowering_path(path):
                            lowered = _timing.lower_calls(case.fn, inputs, chain=True)
                    except _cache.MissingKernelError as error:  # no cubin, and no CuTe-DSL
                        print(f"{progress} {case.label} ({path}) not timed: {error}", flush=True)
                        continue
                    text = hashlib.sha256(lowered.as_text().encode()).digest()
                    if text not in shape_programs:
                        shape_programs[text] = [pool.submit(lowered.compile), case.args, [], False]
                    shape_programs[text][2].append(case.key + suffix)
                    shape_programs[text][3] |= case.kernel and on_gpu and path == "kernel"
    for i, (row, shape_programs) in enumerate(zip(rows, programs, strict=True), 1):
        dtype, m, n = row["dtype"], row["m"], row["n"]
        progress = f"  {op.name} {dtype} {m}x{n} ({i} of {len(shapes)})"
        print(f"{progress}: timing", file=sys.stderr, flush=True)
        arguments = _timing.make_inputs(op.arguments(m, n, dtype), row["k"], seed=m * n)
        timed = []
        for compiled, args, _, require_kernel in shape_programs.values():
            if require_kernel:
                _timing.check_kernel(compiled.result())
            timed.append((compiled.result(), [a[:args] for a in arguments]))
        seconds = _timing.time_compiled(timed, reps, LATENCY_WARMUP)
        for t, (_, _, keys, _) in zip(seconds, shape_programs.values(), strict=True):
            row |= dict.fromkeys(keys, t)
        del arguments, timed
        shape_programs.clear()  # the executables
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m quack_jax.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=pathlib.Path, help="write <op>.{md,json,png} here")
    ops = benchmarks()
    parser.add_argument(
        "--ops", nargs="+", default=list(ops), choices=list(ops), help="ops to time; default: all"
    )
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--tune", action="store_true", help="also time candidate tilings")
    parser.add_argument(
        "--latency",
        action="store_true",
        help="microseconds per op at small and decode shapes, each op a chain of K "
        "(<op>_latency.md and .json); with --quick, rows 1 and 64 at one row length",
    )
    parser.add_argument(
        "--reps",
        type=int,
        help=f"timed samples per function (their median is reported); default: 7, "
        f"{LATENCY_REPS} with --latency",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPES,
        help="input dtypes; default: both, bfloat16 alone with --latency",
    )
    parser.add_argument("--sizes", nargs="+", type=int, help="only shapes with these N")
    args = parser.parse_args(argv)
    if args.tune and (args.latency or not _timing.kernel_device()):
        parser.error("--tune times kernels, so it needs a GPU that runs them, and no --latency")
    args.dtypes = args.dtypes or (["bfloat16"] if args.latency else DTYPES)
    args.reps = args.reps or (LATENCY_REPS if args.latency else 7)
    fallback = not _timing.kernel_device()
    print(_timing.describe(), flush=True)
    if not args.quick and jax.devices()[0].platform == "cpu" and args.latency:
        print(
            "The latency shapes are sized for a GPU: on a CPU the large ones take minutes "
            "each, and rms_norm's largest QK-norm rows (2097152 x 256) more than 23 GB of "
            "memory. --latency --quick runs two small shapes per op in seconds.",
            flush=True,
        )
    elif not args.quick and jax.devices()[0].platform == "cpu":
        print(
            "The full shapes are sized for a GPU: on a CPU they take hours (about two on 2 "
            "cores). --quick runs small shapes in under a minute.",
            flush=True,
        )
    if importlib.util.find_spec("flax") is None and not args.latency:
        print("flax is not installed: the norms' Flax columns stay empty", flush=True)
    for name in args.ops:
        op = ops[name]
        if args.latency:
            grid = latency_shapes(op, args.quick)
        else:
            grid = op.quick_shapes if args.quick else op.shapes
        shapes = [
            (dtype, m, n)
            for dtype in args.dtypes
            for m, n in grid
            if not args.sizes or n in args.sizes
        ]
        if not shapes:  # e.g. --latency of an op without latency shapes
            continue
        if args.latency:
            rows = bench_latency(op, shapes, args.reps)
        else:
            rows = []
            for i, (dtype, m, n) in enumerate(shapes, 1):
                progress = f"  {name} {dtype} {m}x{n} ({i} of {len(shapes)})"
                print(progress, file=sys.stderr, flush=True)
                rows.append(bench_shape(op, m, n, dtype, args.reps, args.tune, args.quick))
        title, stem = (f"{name} latency", f"{name}_latency") if args.latency else (name, name)
        header = (
            f"{title}, {datetime.date.today()}, {_timing.describe()}, jax {jax.__version__}\n\n"
        )
        if args.latency:
            header += LATENCY_NOTE + ("" if fallback else SPEEDUP_NOTE) + "\n\n"
        if fallback:
            header += "No speedups: quack_jax ran its XLA fallback, so it times XLA too.\n\n"
        report = header + table(op, rows, fallback, latency_columns(op) if args.latency else None)
        if args.tune:
            report += "\n\nTuning (each candidate tiling timed alone):\n\n" + tuning_table(op, rows)
        print(report, flush=True)
        if args.out and rows:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{stem}.md").write_text(report + "\n")
            meta = {
                "date": str(datetime.date.today()),
                "device": _timing.describe(),
                "jax": jax.__version__,
                "options": {k: v for k, v in vars(args).items() if k != "out"},
            }
            if args.latency:  # and the primitives whose default lowering can skip the kernel
                meta |= {"unit": "seconds per op", "reference_faster": sorted(REFERENCE_FASTER)}
            else:
                meta["passes"] = op.passes
            rows_json = json.dumps({"meta": meta, "rows": rows}, indent=1)
            (args.out / f"{stem}.json").write_text(rows_json)
            if not args.latency:
                plot(op, rows, args.out / f"{name}.png", _timing.describe(), DTYPES)


if __name__ == "__main__":
    main()
