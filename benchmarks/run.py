"""quack_jax against XLA, side by side in one process: softmax forward, and forward plus
backward (``jax.vjp``), on the shapes of the project's anchors.

    python benchmarks/run.py                  # the full table on this machine's default device
    python benchmarks/run.py --quick          # small shapes, seconds on a CPU
    python benchmarks/run.py --tune --out DIR # also time every candidate tiling (GPU)

Timing: one jitted function applies the op to K distinct inputs (no common subexpressions,
no L2 reuse), K chosen so one call moves about 10 GB; after a warm-up, each sample is
three back-to-back calls (so host dispatch overlaps the GPU's work), and the result is the
median of the samples divided by 3 K. XLA's ``jax.nn.softmax`` is timed the same way on the
same inputs, and so is the ceiling: ``x * 2`` over float32 arrays of the same byte size.
TB/s counts the bytes the op must move at least: forward 2*M*N*e (read x, write y);
forward+backward, timed as ``jax.vjp`` with the forward output unused, 3*M*N*e (read x
and dy, write dx); e is the element size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import quack_jax
from quack_jax import _ffi
from quack_jax._primitive import KERNEL_ARCHS
from quack_jax._tiling import ITEMSIZE, candidate_tilings, choose_tiling, override_tiling
from quack_jax.softmax import _derivative

SHAPES = [
    (32768, 1024),
    (16384, 4096),
    (8192, 16384),
    (4096, 65536),
    (2048, 131072),
    (1024, 262144),
]
QUICK_SHAPES = [(4096, 1024), (512, 8192)]
DTYPES = ["bfloat16", "float32"]
TARGET_BYTES = 10e9
TUNE_BYTES = 2e9  # tuning ranks candidates, so it can afford a larger dispatch share
MEMORY_BUDGET = 60e9
CALLS_PER_SAMPLE = 3


def kernel_device() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") in KERNEL_ARCHS


def describe() -> str:
    device = jax.devices()[0]
    if kernel_device():
        return f"{device.device_kind}: quack_jax runs its CuTe-DSL kernels (sm_90a)"
    return (
        f"{device.platform.upper()} ({device.device_kind}): no CUDA GPU with compute "
        "capability 9.0, so quack_jax ran its XLA fallback here and both columns are XLA"
    )


def fwd_bwd(fn):
    def f(x, dy):
        _, vjp = jax.vjp(fn, x)
        return vjp(dy)[0]

    return f


def time_per_call(fn, inputs, reps, require_kernel=False):
    """Median seconds per application of ``fn`` over the K argument tuples in ``inputs``."""
    f = jax.jit(lambda inputs: [fn(*args) for args in inputs])
    lowered = f.lower(inputs)
    if require_kernel and f"custom_call @{_ffi.TARGET}" not in lowered.as_text():
        raise RuntimeError("the quack_jax path lowered without a kernel: refusing to time XLA")
    compiled = lowered.compile()
    jax.block_until_ready(compiled(inputs))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(CALLS_PER_SAMPLE):
            out = compiled(inputs)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
        del out
    return statistics.median(times) / (CALLS_PER_SAMPLE * len(inputs))


def make_inputs(shape, dtype, count, arity, seed):
    keys = jax.random.split(jax.random.key(seed), count * arity)
    arrays = [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys]
    return [tuple(arrays[i * arity : (i + 1) * arity]) for i in range(count)]


def bench_shape(m, n, dtype, reps, tune, quick):
    e = ITEMSIZE[dtype]
    size = m * n * e
    count = (
        10
        if quick
        else int(min(max(10, math.ceil(TARGET_BYTES / (2 * size))), MEMORY_BUDGET // (6 * size)))
    )
    on_gpu = kernel_device()
    one = make_inputs((m, n), dtype, count, 1, seed=m + n)
    two = make_inputs((m, n), dtype, count, 2, seed=m * n)
    row = {"dtype": dtype, "m": m, "n": n, "k": count}
    words = make_inputs((m, n * e // 4), "float32", count, 1, seed=m)
    row["copy"] = time_per_call(lambda x: x * 2, words, reps)
    del words
    row["quack_fwd"] = time_per_call(quack_jax.softmax, one, reps, require_kernel=on_gpu)
    row["xla_fwd"] = time_per_call(jax.nn.softmax, one, reps)
    row["quack_fwd_bwd"] = time_per_call(
        fwd_bwd(quack_jax.softmax), two, reps, require_kernel=on_gpu
    )
    row["xla_fwd_bwd"] = time_per_call(fwd_bwd(jax.nn.softmax), two, reps)
    for name in ("fwd", "bwd"):
        row[f"tiling_{name}"] = choose_tiling(f"softmax_{name}", n, e).tag if on_gpu else "-"
    if tune:
        k = max(10, math.ceil(TUNE_BYTES / (2 * size)))
        backward = lambda dy, x: _derivative.bind(dy, x, kind="softmax")[0]  # noqa: E731
        for name, fn, inputs, factor in (
            ("fwd", quack_jax.softmax, one[:k], 2),
            ("bwd", backward, two[:k], 3),
        ):
            results = row[f"tune_{name}"] = {}
            for t in candidate_tilings(f"softmax_{name}", n, e):
                results[t.tag] = _time_with(t, f"softmax_{name}", fn, inputs, reps)
                print(
                    f"tune {dtype} {m}x{n} {name} {t.tag} "
                    f"{tbps(factor * size, results[t.tag]):.3f} TB/s",
                    flush=True,
                )
    del one, two
    return row


def _time_with(tiling, family, fn, inputs, reps):
    with override_tiling(family, tiling.n, ITEMSIZE[inputs[0][0].dtype.name], tiling):
        return time_per_call(fn, inputs, reps, require_kernel=True)


def tbps(nbytes, seconds):
    return nbytes / seconds / 1e12


def table(rows) -> str:
    lines = [
        "| dtype | M x N | copy TB/s | quack fwd TB/s | XLA fwd TB/s | fwd speedup | fwd / copy "
        "| quack fwd+bwd TB/s | XLA fwd+bwd TB/s | fwd+bwd speedup | tilings (fwd, bwd) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        size = r["m"] * r["n"] * ITEMSIZE[r["dtype"]]
        copy = tbps(2 * size, r["copy"])
        qf, xf = tbps(2 * size, r["quack_fwd"]), tbps(2 * size, r["xla_fwd"])
        qb, xb = tbps(3 * size, r["quack_fwd_bwd"]), tbps(3 * size, r["xla_fwd_bwd"])
        lines.append(
            f"| {r['dtype']} | {r['m']} x {r['n']} | {copy:.3g} | {qf:.3g} | {xf:.3g} "
            f"| {r['xla_fwd'] / r['quack_fwd']:.2f}x | {qf / copy:.0%} | {qb:.3g} | {xb:.3g} "
            f"| {r['xla_fwd_bwd'] / r['quack_fwd_bwd']:.2f}x "
            f"| {r['tiling_fwd']}, {r['tiling_bwd']} |"
        )
    return "\n".join(lines)


def tuning_table(rows) -> str:
    lines = ["| dtype | M x N | pass | default | TB/s | best | TB/s |", "| --- " * 7 + "|"]
    for r in rows:
        size = r["m"] * r["n"] * ITEMSIZE[r["dtype"]]
        for name, results, nbytes in (
            ("fwd", r.get("tune_fwd"), 2 * size),
            ("bwd", r.get("tune_bwd"), 3 * size),
        ):
            if not results:
                continue
            default = r[f"tiling_{name}"]
            best = min(results, key=results.get)
            lines.append(
                f"| {r['dtype']} | {r['m']} x {r['n']} | {name} | {default} "
                f"| {tbps(nbytes, results[default]):.2f} | {best} "
                f"| {tbps(nbytes, results[best]):.2f} |"
            )
    return "\n".join(lines)


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(DTYPES), figsize=(7 * len(DTYPES), 4.5), squeeze=False)
    series = [
        ("quack_fwd", 2, "quack_jax fwd"),
        ("xla_fwd", 2, "XLA fwd"),
        ("quack_fwd_bwd", 3, "quack_jax fwd+bwd"),
        ("xla_fwd_bwd", 3, "XLA fwd+bwd"),
    ]
    for ax, dtype in zip(axes[0], DTYPES, strict=True):
        sel = [r for r in rows if r["dtype"] == dtype]
        if not sel:
            continue
        width = 0.2
        for i, (key, factor, label) in enumerate(series):
            values = [tbps(factor * r["m"] * r["n"] * ITEMSIZE[dtype], r[key]) for r in sel]
            ax.bar([j + (i - 1.5) * width for j in range(len(sel))], values, width, label=label)
        copy = [tbps(2 * r["m"] * r["n"] * ITEMSIZE[dtype], r["copy"]) for r in sel]
        ax.plot(range(len(sel)), copy, "k--", marker="_", label="copy (ceiling)")
        ax.set_xticks(range(len(sel)), [f"{r['m']}x{r['n']}" for r in sel], rotation=20)
        ax.set_ylabel("TB/s")
        ax.set_title(f"softmax, {dtype}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, help="write softmax.{md,json,png} here")
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--tune", action="store_true", help="also time candidate tilings")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES)
    parser.add_argument("--sizes", nargs="+", type=int, help="only shapes with these N")
    args = parser.parse_args(argv)
    if args.tune and not kernel_device():
        parser.error("--tune times kernels, so it needs a GPU that runs them")
    print(describe(), flush=True)
    rows = []
    for dtype in args.dtypes:
        for m, n in QUICK_SHAPES if args.quick else SHAPES:
            if args.sizes and n not in args.sizes:
                continue
            rows.append(bench_shape(m, n, dtype, args.reps, args.tune, args.quick))
            print(f"  {dtype} {m}x{n} done", file=sys.stderr, flush=True)
    header = f"softmax, {datetime.date.today()}, {describe()}, jax {jax.__version__}\n\n"
    report = header + table(rows)
    if args.tune:
        report += "\n\nTuning (each candidate tiling timed alone):\n\n" + tuning_table(rows)
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "softmax.md").write_text(report + "\n")
        meta = {
            "date": str(datetime.date.today()),
            "device": describe(),
            "jax": jax.__version__,
            "options": {k: v for k, v in vars(args).items() if k != "out"},
        }
        (args.out / "softmax.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        plot(rows, args.out / "softmax.png", describe())


if __name__ == "__main__":
    main()
