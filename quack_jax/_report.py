"""The benchmark's reports: TB/s and microseconds per op, the markdown tables (by op,
--latency and --tune) and the bar plots, from the rows that quack_jax.bench times."""

from __future__ import annotations

import math

from quack_jax._spec import Benchmark
from quack_jax._tiling import ITEMSIZE

# --latency's passes (the keys quack_<pass>, xla_<pass> of the op's cases) and their labels
LATENCY_PASSES = {"fwd": "fwd", "fwd_bwd": "fwd+bwd"}
LATENCY_NOTE = (
    "Microseconds per op, each a chain of K ops in one call (one after the other, as the "
    "layers of a decode step). quack_jax: as lowered by default (kernels, except at the "
    "shapes of _primitive.REFERENCE_FASTER); kernel, reference: its kernels, its XLA "
    "reference forced (lowering_path)."
)
SPEEDUP_NOTE = " Speedup: XLA's time over quack_jax's (default); below 1.00x quack_jax is slower."


def tbps(nbytes, seconds):
    return nbytes / seconds / 1e12


def rate(op: Benchmark, r, key):
    """TB/s of the row's entry ``key``, or None if it was not timed."""
    if r.get(key) is None:
        return None
    return tbps(op.passes[key] * r["m"] * r["n"] * ITEMSIZE[r["dtype"]], r[key])


def cell(op: Benchmark, r, kind, *keys) -> str:
    if kind == "tilings":
        return f"{r['tiling_fwd']}, {r['tiling_bwd']}"
    if kind == "inputs":
        return str(r["k"])
    if kind == "us":  # microseconds
        seconds = r.get(keys[0])
        return "-" if seconds is None else f"{seconds * 1e6:.{2 if seconds < 1e-4 else 0}f}"
    values = [rate(op, r, key) for key in keys]
    if None in values:
        return "-"
    if kind == "rate":
        return f"{values[0]:.3g}"
    if kind == "speedup":  # the ratio of the times: the first key is the slower one
        return f"{values[1] / values[0]:.2f}x"
    return f"{values[0] / values[1]:.0%}"  # fraction


def latency_columns(op: Benchmark) -> list[tuple]:
    """--latency's columns: per pass, quack_jax's µs by default, with the kernels and with
    the reference forced, XLA's µs, and XLA's time over quack_jax's (by default)."""
    keys = {case.key for case in op.cases}
    columns = [("K", "inputs")]
    for p, label in LATENCY_PASSES.items():
        if f"quack_{p}" in keys:
            columns += [
                (f"quack_jax {label} µs", "us", f"quack_{p}"),
                (f"kernel {label} µs", "us", f"quack_{p}_kernel"),
                (f"reference {label} µs", "us", f"quack_{p}_reference"),
            ]
        if f"xla_{p}" in keys:
            columns.append((f"XLA {label} µs", "us", f"xla_{p}"))
        if {f"quack_{p}", f"xla_{p}"} <= keys:
            columns.append((f"{label} speedup", "speedup", f"xla_{p}", f"quack_{p}"))
    return columns


def table(op: Benchmark, rows, fallback: bool, columns=None) -> str:
    """The op's table (``columns``, by default the op's); with ``fallback`` (quack_jax ran
    its XLA fallback, so its columns time XLA too) without the speedup columns."""
    columns = [c for c in columns or op.columns if not (fallback and c[1] == "speedup")]
    headers = ["dtype", "M x N"] + [c[0] for c in columns]
    lines = ["| " + " | ".join(headers) + " |", "| --- " * len(headers) + "|"]
    for r in rows:
        cells = [r["dtype"], f"{r['m']} x {r['n']}"] + [cell(op, r, *c[1:]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tuning_table(op: Benchmark, rows) -> str:
    lines = ["| dtype | M x N | pass | default | TB/s | best | TB/s |", "| --- " * 7 + "|"]
    for r in rows:
        size = r["m"] * r["n"] * ITEMSIZE[r["dtype"]]
        for t in op.tuned:
            results = r.get(f"tune_{t.name}")
            if not results:
                continue
            default = next(iter(results))  # the first candidate: the launched tiling
            best = min(results, key=results.get)
            lines.append(
                f"| {r['dtype']} | {r['m']} x {r['n']} | {t.name} | {default} "
                f"| {tbps(t.passes * size, results[default]):.2f} | {best} "
                f"| {tbps(t.passes * size, results[best]):.2f} |"
            )
    return "\n".join(lines)


def bar_panel(ax, rows, series, copy):
    """One plot panel: a group of bars per row (``series`` maps a label to a TB/s per row)
    and the copy ceiling as a dashed line."""
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        heights = [math.nan if v is None else v for v in values]  # None: not timed
        ax.bar([j + offset for j in range(len(rows))], heights, width, label=label)
    ax.plot(range(len(rows)), copy, "k--", marker="_", label="copy (ceiling)")
    ax.set_xticks(range(len(rows)), [f"{r['m']}x{r['n']}" for r in rows], rotation=20)
    ax.set_ylabel("TB/s")


def save_figure(fig, legend_from, path, title):
    """A legend (the panel ``legend_from``'s) below the panels, the title above; saved, closed."""
    import matplotlib.pyplot as plt

    handles, labels = legend_from.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(op: Benchmark, rows, path, title, dtypes):
    """The op's bars, a panel per dtype of ``dtypes``, saved to ``path``."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {path.name}", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        sel = [r for r in rows if r["dtype"] == dtype]
        if not sel:
            continue
        series = {case.label: [rate(op, r, case.key) for r in sel] for case in op.cases}
        bar_panel(ax, sel, series, [rate(op, r, "copy") for r in sel])
        ax.set_title(f"{op.name}, {dtype}")
    save_figure(fig, next(ax for ax in axes[0] if ax.has_data()), path, title)
