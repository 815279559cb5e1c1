"""Kernel-level timing with Nsight Compute, free of launch gaps and dispatch.

    ncu --clock-control none --csv --print-units base --log-file ncu.csv \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        python benchmarks/profile_kernels.py
    python benchmarks/profile_kernels.py --report ncu.csv

The first form runs each benchmark shape of each op once (``--ops``, default all): every
function the benchmark times (quack_jax's forward and vjp, XLA's, Flax's for the norms)
and a copy; the second prints each kernel's duration and achieved DRAM bandwidth.
"""

import argparse
import csv
import sys
from collections import defaultdict


def run(ops):
    import jax

    from quack_jax.bench import DTYPES, benchmarks, make_inputs

    for name in ops:
        op = benchmarks()[name]
        for dtype in DTYPES:
            for m, n in op.shapes:
                (arguments,) = make_inputs(op.arguments(m, n, dtype), 1, seed=m)
                for case in op.cases:
                    jax.block_until_ready(jax.jit(case.fn)(*arguments[: case.args]))
                jax.block_until_ready(jax.jit(lambda x: x * 2)(arguments[0]))


def report(path):
    """Per kernel: duration and DRAM bytes, from ncu's CSV (times in ns, sizes in bytes)."""
    rows = defaultdict(dict)
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    units = set()
    for rec in csv.DictReader(lines):
        key = (rec["ID"], rec["Kernel Name"][:56], rec["Grid Size"])
        scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3}.get(rec["Metric Unit"], 1.0)
        rows[key][rec["Metric Name"]] = float(rec["Metric Value"].replace(",", "")) * scale
        units.add((rec["Metric Name"], rec["Metric Unit"]))
    print("units:", sorted(units))
    print(f"{'kernel':56s} {'grid':>14s} {'us':>9s} {'MB':>9s} {'TB/s':>6s}")
    for (_, name, grid), m in rows.items():
        seconds = m.get("gpu__time_duration.sum", 0.0)
        nbytes = m.get("dram__bytes_read.sum", 0.0) + m.get("dram__bytes_write.sum", 0.0)
        if nbytes > 32e6 and seconds > 0:
            print(
                f"{name:56s} {grid:>14s} {seconds * 1e6:9.1f} {nbytes / 1e6:9.1f} "
                f"{nbytes / seconds / 1e12:6.2f}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--report", help="an ncu CSV log to summarise")
    parser.add_argument("--ops", nargs="+", help="the benchmark's ops to run (default: all)")
    args = parser.parse_args()
    if args.report:
        report(args.report)
    else:
        from quack_jax.bench import benchmarks

        run(args.ops or list(benchmarks()))
    sys.exit(0)
