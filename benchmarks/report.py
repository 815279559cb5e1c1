"""The side-by-side report: quack_jax, XLA and QuACK for PyTorch from one bench folder.

    python -m quack_jax.bench --out DIR
    python benchmarks/quack_torch.py --like DIR
    python benchmarks/report.py DIR [--notes ANALYSIS.md]

Writes ``DIR/report.md`` (two tables per op: end to end, the copy ceiling then forward
and forward+backward TB/s of each implementation and quack_jax's ratio to QuACK; and by
kernel time, the same TB/s from the device time of each function's kernels, where
``benchmarks/profile_kernels.py report DIR`` wrote ``DIR/kernel_times.json``; rows where
quack_jax is more than 3% behind QuACK, or behind XLA, are listed) and ``DIR/report.png``
(bars per op and dtype, the copy ceiling as a line). ``--notes`` puts a hand-written
section (the analysis of those rows) after the header.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from quack_jax import bench
from quack_jax._report import bar_panel, save_figure

OPS = tuple(bench.benchmarks())
CASES = ("fwd", "fwd_bwd")
IMPLS = ("quack_jax", "QuACK", "XLA")
BEHIND = 0.97  # quack_jax / QuACK below this is listed as behind
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def load(folder: pathlib.Path):
    """{op: [row]}, each row with TB/s per (impl, case) and the copy ceiling; the metadata."""
    quack = json.loads((folder / "quack_torch.json").read_text())
    theirs = {(r["op"], r["dtype"], r["m"], r["n"]): r for r in quack["rows"]}
    profiled = folder / "kernel_times.json"
    kernel_seconds = {
        (k["stack"], k["op"], k["dtype"], k["m"], k["n"], k["pass_"]): k["seconds"]
        for k in (json.loads(profiled.read_text()) if profiled.exists() else [])
    }
    tables, meta = {}, {"QuACK": quack["meta"]}
    for op in OPS:
        path = folder / f"{op}.json"
        if not path.exists():
            continue
        bench = json.loads(path.read_text())
        meta["bench"] = bench["meta"]
        passes = bench["meta"]["passes"]
        rows = []
        for r in bench["rows"]:
            row = dict(dtype=r["dtype"], m=r["m"], n=r["n"], copy=_rate(passes, r, "copy"))
            other = theirs.get((op, r["dtype"], r["m"], r["n"]), {})
            for case in CASES:
                row["quack_jax", case] = _rate(passes, r, f"quack_{case}")
                row["XLA", case] = _rate(passes, r, f"xla_{case}")
                row["QuACK", case] = other.get(f"{case}_tbps")
                for impl in (*IMPLS, "copy"):
                    t = kernel_seconds.get((impl, op, r["dtype"], r["m"], r["n"], case))
                    counted = "copy" if impl == "copy" else f"quack_{case}"
                    row[impl, case, "kernel"] = _tbps(passes, r, counted, t)
            rows.append(row)
        tables[op] = rows
    meta["kernel_times"] = bool(kernel_seconds)
    return tables, meta


def _rate(passes, r, key):
    """TB/s of a bench row's entry ``key`` (seconds per application), None if not timed."""
    return _tbps(passes, r, key, r[key])


def _tbps(passes, r, key, seconds):
    """TB/s of the bytes the bench's entry ``key`` counts for row ``r``, moved in
    ``seconds``; None if not timed."""
    if seconds is None:
        return None
    return passes[key] * r["m"] * r["n"] * ITEMSIZE[r["dtype"]] / seconds / 1e12


def ratio(row, case, other="QuACK", *kernel):
    """quack_jax's TB/s over ``other``'s (end to end, or by kernel time with "kernel")."""
    ours, theirs = row[("quack_jax", case, *kernel)], row[(other, case, *kernel)]
    return None if ours is None or theirs is None else ours / theirs


def markdown(tables, meta, notes: str) -> str:
    bench, quack = meta["bench"], meta["QuACK"]
    lines = [
        f"# quack_jax beside QuACK for PyTorch and XLA, {bench['date']}",
        "",
        f"{bench['device']}; jax {bench['jax']}; QuACK {quack['quack']} on torch "
        f"{quack['torch']} (CUDA {quack['cuda']}). quack_jax and XLA timed by `python -m "
        "quack_jax.bench`, QuACK by `benchmarks/quack_torch.py --like` on the bench's rows "
        "(same shapes, random normal inputs), in separate processes.",
        "",
        "TB/s counts the bytes each op must move at least (see `python -m quack_jax.bench "
        "--help`): forward+backward counts the backward's reads and writes too, so it can "
        "pass the copy's figure when the forward's output stays in L2. The copy ceiling is "
        "`x * 2` over float32 arrays of the same byte size. quack_jax and XLA are timed in "
        "one jitted function over K distinct inputs (about 10 GB a call); QuACK over K "
        "distinct inputs (about 4 GB), eagerly and from a CUDA graph, the faster of the two.",
        "",
        "![TB/s per op](report.png)",
        "",
    ]
    if notes:
        lines += [notes.strip(), ""]
    behind = []
    for op, rows in tables.items():
        lines += [f"## {op}", "", "End to end, TB/s:", "", *_table(op, rows, (), behind), ""]
        if meta["kernel_times"]:
            lines += ["By kernel time (ncu), TB/s:", "", *_table(op, rows, ("kernel",), behind)]
            lines.append("")
    lines += ["## Where quack_jax is behind QuACK (below 0.97x) or XLA (below 1.00x)", ""]
    lines += [f"- {b}" for b in behind] or ["- nowhere"]
    return "\n".join(lines) + "\n"


def _table(op, rows, kernel, behind):
    """The op's table of TB/s (end to end, or by kernel time with ``kernel``); appends the
    rows behind QuACK or XLA to ``behind``."""
    how = "kernel time" if kernel else "end to end"
    lines = [
        "| dtype | M x N | copy | quack_jax fwd | QuACK fwd | XLA fwd | vs QuACK | vs XLA "
        "| quack_jax fwd+bwd | QuACK fwd+bwd | XLA fwd+bwd | vs QuACK | vs XLA |",
        "| --- " * 13 + "|",
    ]
    for row in rows:
        copy = row[("copy", "fwd", *kernel)] if kernel else row["copy"]
        cells = [row["dtype"], f"{row['m']} x {row['n']}", _fmt(copy)]
        for case in CASES:
            cells += [_fmt(row[(impl, case, *kernel)]) for impl in IMPLS]
            for other, least in (("QuACK", BEHIND), ("XLA", 1.0)):
                r = ratio(row, case, other, *kernel)
                cells.append("-" if r is None else f"{r:.2f}x")
                if r is not None and r < least:
                    shape = f"{row['dtype']} {row['m']} x {row['n']}"
                    behind.append(f"{op} {case} {shape}: {r:.2f}x of {other} ({how})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _fmt(value):
    return "-" if value is None else f"{value:.2f}"


def plot(tables, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for rows in tables.values() for r in rows})
    panels = [(op, dtype, case) for op in tables for case in CASES for dtype in dtypes]
    cols = 2 * len(dtypes)
    fig, axes = plt.subplots(len(tables), cols, figsize=(5 * cols, 3.6 * len(tables)))
    axes = axes.reshape(len(tables), cols)
    for ax, (op, dtype, case) in zip(axes.flat, panels, strict=True):
        rows = [r for r in tables[op] if r["dtype"] == dtype]
        series = {impl: [r[impl, case] for r in rows] for impl in IMPLS}
        bar_panel(ax, rows, series, [r["copy"] for r in rows])
        ax.tick_params(labelsize=7)
        ax.set_title(f"{op} {case.replace('_', '+')}, {dtype}", fontsize=9)
    save_figure(fig, axes.flat[0], path, title)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--notes", type=pathlib.Path, help="markdown put after the header")
    args = parser.parse_args(argv)
    tables, meta = load(args.folder)
    notes = args.notes.read_text() if args.notes else ""
    (args.folder / "report.md").write_text(markdown(tables, meta, notes))
    title = f"{meta['bench']['device']}, {meta['bench']['date']}"
    plot(tables, args.folder / "report.png", title)


if __name__ == "__main__":
    main()
