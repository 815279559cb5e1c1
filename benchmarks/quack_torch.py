"""QuACK for PyTorch (``quack-kernels``) on run.py's shapes, timed the same way, so its
figures sit beside quack_jax's and XLA's from the same machine and day.

    python benchmarks/quack_torch.py --out DIR     # needs torch, CUDA and quack-kernels

Each op runs forward (``quack.softmax``, ``quack.rmsnorm`` with a float32 weight,
``quack.cross_entropy`` with the mean) and forward+backward (``torch.autograd.grad``
w.r.t. the input, and the weight for RMSNorm) on K distinct inputs per sample, three
back-to-back rounds per sample, the median of the samples divided by 3 K: run.py's method
with a Python loop for its jitted one. TB/s counts run.py's bytes (its ``passes``). The
first call of each shape compiles QuACK's kernel (CuTe-DSL JIT) and is not timed.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import time

import quack
import torch

SHAPES = {
    "softmax": [(16384, 4096), (8192, 16384), (4096, 65536)],
    "rms_norm": [(16384, 4096), (8192, 8192), (4096, 16384)],
    "cross_entropy": [(8192, 32000), (4096, 128256), (2048, 262144)],
}
PASSES = {  # run.py's byte counts, in units of M*N*e
    "softmax": {"fwd": 2, "fwd_bwd": 3},
    "rms_norm": {"fwd": 2, "fwd_bwd": 5},
    "cross_entropy": {"fwd": 1, "fwd_bwd": 2},
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
TARGET_BYTES = 4e9


def inputs(op, m, n, dtype, count):
    """``count`` tuples of distinct arguments: x (and the weight or labels), dy."""
    out = []
    for _ in range(count):
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        dy = torch.randn(m, n, device="cuda", dtype=dtype)
        if op == "rms_norm":
            extra = (torch.randn(n, device="cuda", dtype=torch.float32),)
        elif op == "cross_entropy":
            extra = (torch.randint(0, n, (m,), device="cuda"),)
        else:
            extra = ()
        out.append((x, *extra, dy))
    return out


def forward(op):
    return {
        "softmax": lambda x, dy: quack.softmax(x),
        "rms_norm": lambda x, w, dy: quack.rmsnorm(x, w, eps=1e-6),
        "cross_entropy": lambda x, labels, dy: quack.cross_entropy(x, labels),
    }[op]


def forward_backward(op):
    def softmax(x, dy):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(quack.softmax(x), x, dy)

    def rms_norm(x, w, dy):
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = quack.rmsnorm(x, w, eps=1e-6)
        return y, torch.autograd.grad(y, (x, w), dy)

    def cross_entropy(x, labels, dy):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(quack.cross_entropy(x, labels), x)

    return {"softmax": softmax, "rms_norm": rms_norm, "cross_entropy": cross_entropy}[op]


def time_per_call(fn, args, reps):
    fn(*args[0])  # compiles the kernels
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(3):
            for a in args:
                fn(*a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / (3 * len(args))


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=list(DTYPES))
    args = parser.parse_args(argv)
    rows = []
    for op, shapes in SHAPES.items():
        for dtype in args.dtypes:
            for m, n in shapes:
                e = torch.finfo(DTYPES[dtype]).bits // 8
                count = max(4, math.ceil(TARGET_BYTES / (2 * m * n * e)))
                data = inputs(op, m, n, DTYPES[dtype], count)
                row = dict(op=op, dtype=dtype, m=m, n=n, k=count)
                for case, fn in (("fwd", forward(op)), ("fwd_bwd", forward_backward(op))):
                    seconds = time_per_call(fn, data, args.reps)
                    row[case] = seconds
                    row[f"{case}_tbps"] = PASSES[op][case] * m * n * e / seconds / 1e12
                rows.append(row)
                print(row, flush=True)
                del data
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
        meta["quack"] = quack.__version__
        (args.out / "quack_torch.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
