"""The summary of the small and decode shapes from one latency folder.

    python -m quack_jax.bench --latency --out DIR        # DIR/<op>_latency.json
    python benchmarks/profile_kernels.py report DIR      # optional: DIR/kernel_times.json
    python benchmarks/latency_summary.py DIR             # writes DIR/summary.md

``DIR/summary.md`` holds: a table of M (1 to 4096 rows) by the common row lengths
(RMSNorm and softmax at N = 4096, cross-entropy at V = 128256), each cell quack_jax / XLA
µs per op as lowered by default and XLA's time over quack_jax's; the QK-norm rows
(RMSNorm over rows of 64, 128 and 256); and per op and group of shapes (M <= 512, the
QK-norm rows, M = 4096) the sums of XLA's time over quack_jax's: end to end in the
chains (in brackets, with the kernels forced and with quack_jax's XLA reference forced),
and by kernel time where ncu ran (``kernel_times.json`` of ``profile_kernels.py``; "-"
where a function has no kernel time). Ops or shapes missing from DIR are left out or
shown as "-".
"""

import argparse
import json
import pathlib

PASSES = {"fwd": "fwd", "fwd_bwd": "fwd+bwd"}
QK = (64, 128, 256)


def groups(op, rows):
    """(label, rows) per group of shapes: M <= 512, QK-norm rows (RMSNorm), M = 4096."""
    qk = [r for r in rows if r["n"] in QK]
    small = [r for r in rows if r["n"] not in QK and r["m"] <= 512]
    large = [r for r in rows if r["n"] not in QK and r["m"] == 4096]
    out = [("M <= 512", small)] + ([("QK-norm rows", qk)] if qk else []) + [("M = 4096", large)]
    return [(label, g) for label, g in out if g]


def ratio(rows, key, base):
    return sum(r[base] for r in rows) / sum(r[key] for r in rows)


def kernel_ratio(times, op, rows, pass_):
    """XLA's summed kernel time over quack_jax's, over ``rows``; None if ncu missed one."""
    total = {"quack_jax": 0.0, "XLA": 0.0}
    for r in rows:
        for stack in total:
            t = times.get((stack, op, r["m"], r["n"], pass_))
            if t is None:
                return None
            total[stack] += t
    return total["XLA"] / total["quack_jax"]


def main(folder: pathlib.Path):
    tables = {
        p.name.removesuffix("_latency.json"): json.loads(p.read_text())
        for p in sorted(folder.glob("*_latency.json"))
    }
    times = {}
    if (folder / "kernel_times.json").exists():
        for e in json.loads((folder / "kernel_times.json").read_text()):
            key = (e["stack"], e["op"], e["m"], e["n"], e["pass_"])
            times[key] = e["seconds"]
    meta = next(iter(tables.values()))["meta"]
    by = {op: {(r["m"], r["n"]): r for r in t["rows"]} for op, t in tables.items()}

    def cell(op, m, n, p):
        r = by.get(op, {}).get((m, n))
        if r is None:
            return "-"
        q, x = r[f"quack_{p}"] * 1e6, r[f"xla_{p}"] * 1e6
        return f"{q:.1f} / {x:.1f} ({x / q:.2f})"

    lines = [
        f"# Small and decode shapes, µs per op ({meta['device'].split(':')[0]}, "
        f"{meta['date']}, jax {meta['jax']}, bfloat16)",
        "",
        "quack_jax as lowered by default (the small-shape rules of `quack_jax._primitive`), "
        "beside XLA in the "
        "same run; each op one of a chain of K in a jitted call (`python -m quack_jax.bench "
        "--latency`). Each cell: quack_jax / XLA µs, and in brackets XLA's time over "
        "quack_jax's (below 1.00 quack_jax is slower). The per-op tables beside this file "
        "have every shape, with the kernels forced and the XLA reference forced.",
        "",
        "| M | rms_norm fwd, N=4096 | rms_norm fwd+bwd | softmax fwd, N=4096 | softmax fwd+bwd "
        "| CE fwd, V=128256 | CE grad |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in (1, 8, 64, 512, 4096):
        cells = [
            cell(op, m, n, p)
            for op, n in (("rms_norm", 4096), ("softmax", 4096), ("cross_entropy", 128256))
            for p in PASSES
        ]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "QK-norm (RMSNorm over rows of 64, 128, 256):", ""]
    lines += ["| M x N | fwd | fwd+bwd |", "| --- | --- | --- |"]
    for m in (32768, 262144, 2097152):
        for n in QK:
            if (m, n) in by.get("rms_norm", {}):
                cells = [cell("rms_norm", m, n, p) for p in PASSES]
                lines.append(f"| {m} x {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Summed over each group of shapes: XLA's time over quack_jax's, as lowered by default "
        "(in brackets: with the kernels forced, and with quack_jax's XLA reference forced); "
        "then by kernel time (ncu, each function alone, as lowered by default).",
        "",
        "| op | rows | shapes | fwd | fwd+bwd | fwd, kernel time | fwd+bwd, kernel time |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for op, table in tables.items():
        for label, rows in groups(op, table["rows"]):
            cells = []
            for p in PASSES:
                base = f"xla_{p}"
                q, k, ref = (f"quack_{p}{s}" for s in ("", "_kernel", "_reference"))
                cells.append(
                    f"{ratio(rows, q, base):.2f} ({ratio(rows, k, base):.2f}, "
                    f"{ratio(rows, ref, base):.2f})"
                )
            for p in PASSES:
                kr = kernel_ratio(times, op, rows, p)
                cells.append("-" if kr is None else f"{kr:.2f}")
            lines.append(f"| {op} | {label} | {len(rows)} | " + " | ".join(cells) + " |")
    (folder / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=pathlib.Path, help="a bench --latency --out folder")
    main(parser.parse_args().folder)
