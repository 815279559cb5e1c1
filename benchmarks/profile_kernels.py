"""Kernel time per op from Nsight Compute, measured the same way for quack_jax, XLA and
QuACK for PyTorch, on the rows of a ``quack_jax.bench`` run:

    python -m quack_jax.bench --out DIR
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \\
        --csv --print-units base \\
        --log-file DIR/ncu_jax.csv python benchmarks/profile_kernels.py jax DIR
    ncu ...same... --log-file DIR/ncu_quack.csv python benchmarks/profile_kernels.py quack DIR
    python benchmarks/profile_kernels.py report DIR

With ``--op OP`` (and ``--dtype DTYPE``) a run takes only those rows and names its files
``<stack>_<op>[_<dtype>]`` (``ncu_jax_softmax.csv``, ``jax_softmax_labels.json``): one
process per op or per op and dtype, so that a time limit or a crash costs those figures,
not all of them.

``DIR`` may also be a ``python -m quack_jax.bench --latency --out DIR`` folder: then the
rows are those of ``DIR/<op>_latency.json``, the small and decode shapes, each function
run once as it is lowered by default (not in a chain).

``jax`` runs, for every row of ``DIR/<op>.json``, quack_jax's and XLA's forward and
forward+backward (the bench's functions) once each on one input, and the bench's copy
(``x * 2`` over float32 arrays of the same bytes); ``quack`` runs QuACK's
(``quack_torch.py``'s functions). Each function runs once to compile and warm up, then
once between two marker kernels (``torch.cuda._sleep``, named ``spin_kernel``), and the
labels of the marked runs go to ``DIR/<stack>_labels.json`` in order, after each run.
Only the marked runs are profiled (``cudaProfilerStart`` and ``Stop`` around them, for
ncu's ``--profile-from-start off``): under ncu, XLA's compile-time autotuning would
otherwise profile every candidate kernel, which made a run too slow to finish.
ncu serialises the kernels and, by default, flushes the caches before each one, so every
stack's kernels start cold and alone. ``report`` splits each ncu log at the markers and
sums each marked run's kernels (a function's whole device time: its kernels, and any
copies, converts or fills its framework launches), into ``DIR/kernel_times.json``:
seconds and the kernels' names per (stack, op, dtype, M, N, pass); and into
``DIR/kernel_times.md``, the µs of each stack side by side, with XLA's and QuACK's time
over quack_jax's per row and summed per op and pass.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys

MARKER = "spin_kernel"
PASSES = ("fwd", "fwd_bwd")
STACKS = ("quack_jax", "XLA", "QuACK")  # the stacks of kernel_times.md, in its order


def bench_rows(folder: pathlib.Path, op: str | None, dtype: str | None):
    """(op, row) for every row of the bench's JSONs in ``folder``, its tables
    (``<op>.json``) or its ``--latency`` tables (``<op>_latency.json``), of ``op`` and
    ``dtype`` only, where given."""
    for path in sorted(folder.glob("*.json")):
        bench = json.loads(path.read_text())
        meta = bench.get("meta", {}) if isinstance(bench, dict) else {}
        name = path.stem.removesuffix("_latency")
        is_bench = "passes" in meta or meta.get("unit") == "seconds per op"
        if is_bench and op in (None, name):
            rows = (r for r in bench["rows"] if dtype in (None, r["dtype"]))
            yield from ((name, r) for r in rows)


def run_marked(functions, path: pathlib.Path, sync) -> None:
    """Warm each (label, thunk) up, then run it once between two markers; the labels so
    far go to ``path`` after each run."""
    import torch

    labels = []
    for label, thunk in functions:
        sync(thunk())
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        torch.cuda._sleep(1000)
        sync(thunk())
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        labels.append(label)
        path.write_text(json.dumps(labels, indent=1))


def jax_functions(folder: pathlib.Path, *only):
    import jax

    from quack_jax._tiling import ITEMSIZE
    from quack_jax._timing import make_inputs
    from quack_jax.bench import benchmarks

    ops = benchmarks()
    for op_name, r in bench_rows(folder, *only):
        op, (m, n, dtype) = ops[op_name], (r["m"], r["n"], r["dtype"])
        (arguments,) = make_inputs(op.arguments(m, n, dtype), 1, seed=m * n)
        (words,) = make_inputs([((m, n * ITEMSIZE[dtype] // 4), "float32")], 1, seed=m)
        copy = jax.jit(lambda x: x * 2)
        label = dict(stack="copy", op=op_name, dtype=dtype, m=m, n=n, pass_="fwd")
        yield label, lambda f=copy, a=words: f(*a)
        for impl in ("quack", "xla"):
            for pass_ in PASSES:
                case = next(c for c in op.cases if c.key == f"{impl}_{pass_}")
                fn = jax.jit(case.fn)
                args = arguments[: case.args]
                label = dict(stack="quack_jax" if impl == "quack" else "XLA", op=op_name)
                yield label | dict(dtype=dtype, m=m, n=n, pass_=pass_), lambda f=fn, a=args: f(*a)


def quack_functions(folder: pathlib.Path, *only):
    import torch
    from quack_torch import DTYPES, OPS, forward, forward_backward, inputs

    for op_name, r in bench_rows(folder, *only):
        if op_name not in OPS:  # token_logprobs
            continue
        m, n, dtype = r["m"], r["n"], r["dtype"]
        (arguments,) = inputs(op_name, m, n, DTYPES[dtype], 1)
        for pass_, fn in zip(PASSES, (forward(op_name), forward_backward(op_name)), strict=True):
            label = dict(stack="QuACK", op=op_name, dtype=dtype, m=m, n=n, pass_=pass_)

            def thunk(f=fn, a=arguments, label=label):
                try:
                    return f(*a)
                except Exception as error:  # QuACK does not compile some shapes
                    print(f"QuACK {label}: {type(error).__name__}: {str(error)[:200]}")
                    return None

            yield label, thunk
        del arguments
        torch.cuda.empty_cache()


def ncu_kernels(path: pathlib.Path):
    """(name, seconds) of every kernel in ncu's CSV log, in launch order."""
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    kernels = {}
    for rec in csv.DictReader(lines):
        if rec["Metric Name"] == "gpu__time_duration.sum":
            unit = rec["Metric Unit"].removesuffix("second").removesuffix("s") or "s"
            scale = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "s": 1.0}[unit]
            value = float(rec["Metric Value"].replace(",", "")) * scale
            kernels[int(rec["ID"])] = (rec["Kernel Name"], value)
    return [kernels[i] for i in sorted(kernels)]


def marked_runs(kernels):
    """The kernels between the 2j-th and (2j+1)-th markers, for each j."""
    segments, current = [], []
    for name, seconds in kernels:
        if MARKER in name:
            segments.append(current)
            current = []
        else:
            current.append((name, seconds))
    return segments[1::2]


def rounds(folder: pathlib.Path) -> dict:
    """For an experiment that gave ``run_marked`` its labelled functions several times
    over (``folder/labels.json``, ncu's log ``folder/ncu.csv``): label -> (µs of each of
    its marked runs, kernels in a run)."""
    labels = json.loads((folder / "labels.json").read_text())
    times = {}
    for label, kernels in zip(labels, marked_runs(ncu_kernels(folder / "ncu.csv")), strict=False):
        us, _ = times.setdefault(label, ([], len(kernels)))
        us.append(sum(s for _, s in kernels) * 1e6)
    return times


def table(entries) -> str:
    """Markdown: µs per function by kernel time, per op, dtype, shape and pass, for each
    stack profiled, with XLA's and QuACK's time over quack_jax's; then each op's and
    pass's sums over the shapes that every stack ran."""
    times = {}  # (op, dtype, m, n, pass) -> {stack: seconds}
    for e in entries:
        if e["seconds"] is not None:
            key = (e["op"], e["dtype"], e["m"], e["n"], e["pass_"])
            times.setdefault(key, {})[e["stack"]] = e["seconds"]
    stacks = [s for s in STACKS if any(s in t for t in times.values())]
    others = [s for s in stacks if s != "quack_jax"]
    headers = ["op", "dtype", "M x N", "pass"] + [f"{s} µs" for s in stacks]
    headers += [f"{s} / quack_jax" for s in others]
    lines = ["| " + " | ".join(headers) + " |", "| --- " * len(headers) + "|"]
    sums = {}  # (op, pass) -> [seconds of each stack]
    for (op, dtype, m, n, pass_), t in times.items():
        cells = [op, dtype, f"{m} x {n}", pass_]
        cells += [f"{t[s] * 1e6:.1f}" if s in t else "-" for s in stacks]
        mine = t.get("quack_jax")
        cells += [f"{t[s] / mine:.2f}x" if mine and s in t else "-" for s in others]
        lines.append("| " + " | ".join(cells) + " |")
        if all(s in t for s in stacks):
            total = sums.setdefault((op, pass_), [0.0] * len(stacks))
            total[:] = [a + t[s] for a, s in zip(total, stacks, strict=True)]
    if "quack_jax" in stacks and others:
        lines += ["", "Summed over the shapes every stack ran:", ""]
        lines += ["| op | pass | " + " | ".join(f"{s} / quack_jax" for s in others) + " |"]
        lines.append("| --- " * (2 + len(others)) + "|")
        for (op, pass_), total in sums.items():
            mine = total[stacks.index("quack_jax")]
            ratios = [f"{total[stacks.index(s)] / mine:.2f}x" for s in others]
            lines.append(f"| {op} | {pass_} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def report(folder: pathlib.Path) -> None:
    entries = []
    for path in sorted(folder.glob("*_labels.json")):
        log = folder / f"ncu_{path.name.removesuffix('_labels.json')}.csv"
        if not log.exists():
            print(f"{log.name} is missing: {path.name} left out")
            continue
        labels = json.loads(path.read_text())
        runs = marked_runs(ncu_kernels(log))
        if len(runs) < len(labels):
            print(f"{log.name}: {len(runs)} marked runs for {len(labels)} labels: left out")
            continue
        for label, kernels in zip(labels, runs, strict=True):
            seconds = sum(s for _, s in kernels) if kernels else None
            entries.append(label | dict(seconds=seconds, kernels=[k for k, _ in kernels]))
            print(
                f"{label['stack']:9s} {label['op']:13s} {label['dtype']:8s} "
                f"{label['m']:>6d}x{label['n']:<7d} {label['pass_']:7s} "
                + ("-" if seconds is None else f"{seconds * 1e6:9.1f} us {len(kernels)} kernels")
            )
    (folder / "kernel_times.json").write_text(json.dumps(entries, indent=1))
    (folder / "kernel_times.md").write_text(table(entries) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=("jax", "quack", "report"))
    parser.add_argument("folder", type=pathlib.Path, help="a bench --out folder")
    parser.add_argument("--op", help="only this op's rows")
    parser.add_argument("--dtype", help="only rows of this dtype")
    args = parser.parse_args()
    name = "_".join(filter(None, (args.what, args.op, args.dtype)))
    labels, rows = args.folder / f"{name}_labels.json", (args.op, args.dtype)
    if args.what == "report":
        report(args.folder)
    elif args.what == "jax":
        import jax

        run_marked(jax_functions(args.folder, *rows), labels, jax.block_until_ready)
    else:
        run_marked(quack_functions(args.folder, *rows), labels, lambda _: None)
    sys.exit(0)
