"""Kernel-level timing with Nsight Compute, free of launch gaps and dispatch.

    ncu --clock-control none --csv --log-file ncu.csv \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        python benchmarks/profile_kernels.py
    python benchmarks/profile_kernels.py --report ncu.csv

The first form runs each benchmark shape once (quack_jax forward and vjp, XLA's, a copy);
the second prints each kernel's duration and achieved DRAM bandwidth.
"""

import argparse
import csv
import sys
from collections import defaultdict

SHAPES = [
    (32768, 1024),
    (16384, 4096),
    (8192, 16384),
    (4096, 65536),
    (2048, 131072),
    (1024, 262144),
]


def run():
    import jax
    import jax.numpy as jnp

    import quack_jax

    def vjp(fn):
        return lambda x, dy: jax.vjp(fn, x)[1](dy)[0]

    for dtype in ("bfloat16", "float32"):
        for m, n in SHAPES:
            kx, kd = jax.random.split(jax.random.key(m))
            x = jax.random.normal(kx, (m, n), jnp.float32).astype(dtype)
            dy = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
            for fn, args in (
                (quack_jax.softmax, (x,)),
                (vjp(quack_jax.softmax), (x, dy)),
                (jax.nn.softmax, (x,)),
                (vjp(jax.nn.softmax), (x, dy)),
                (lambda x: x * 2, (x,)),
            ):
                jax.block_until_ready(jax.jit(fn)(*args))


def report(path):
    rows = defaultdict(dict)
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    for rec in csv.DictReader(lines):
        key = (rec["ID"], rec["Kernel Name"][:60], rec["Grid Size"], rec["Block Size"])
        value = float(rec["Metric Value"].replace(",", ""))
        unit = rec["Metric Unit"]
        scale = {
            "nsecond": 1e-9,
            "usecond": 1e-6,
            "msecond": 1e-3,
            "byte": 1,
            "Kbyte": 1e3,
            "Mbyte": 1e6,
            "Gbyte": 1e9,
        }.get(unit, 1)
        rows[key][rec["Metric Name"]] = value * scale
    print(f"{'kernel':60s} {'grid':>16s} {'us':>9s} {'GB':>8s} {'TB/s':>6s}")
    for (_, name, grid, _), m in rows.items():
        t = m.get("gpu__time_duration.sum", 0)
        nbytes = m.get("dram__bytes_read.sum", 0) + m.get("dram__bytes_write.sum", 0)
        if nbytes < 32e6:
            continue
        print(f"{name:60s} {grid:>16s} {t * 1e6:9.1f} {nbytes / 1e9:8.3f} {nbytes / t / 1e12:6.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--report", help="an ncu CSV log to summarise")
    args = parser.parse_args()
    if args.report:
        report(args.report)
    else:
        run()
    sys.exit(0)
