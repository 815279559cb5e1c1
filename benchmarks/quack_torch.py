"""QuACK for PyTorch (``quack-kernels``) on the rows of a ``quack_jax.bench`` run, timed
the same way, so its figures sit beside quack_jax's and XLA's from the same machine and
day.

    python -m quack_jax.bench --out DIR
    python benchmarks/quack_torch.py --like DIR     # needs torch, CUDA and quack-kernels

For every row of ``DIR/<op>.json`` (op, dtype, M x N) it times QuACK's forward
(``quack.softmax``; ``quack.rmsnorm`` with a float32 weight; ``layernorm_fwd`` with a
float32 weight and bias; ``quack.cross_entropy`` with the mean) and forward+backward
(``torch.autograd.grad`` w.r.t. the input, and the weight for RMSNorm; LayerNorm's
``layernorm_fwd`` with the saved statistics, then ``layernorm_bwd``), bfloat16 rows first,
and writes ``DIR/quack_torch.json`` after each row; a rerun times only the rows it lacks.
TB/s counts the bench's bytes (the JSON's ``passes``).

Timing as in the bench: K distinct inputs, each sample three rounds over the K, the median
of the samples divided by 3 K. A round is launched two ways: eagerly from Python, and
replayed from a CUDA graph captured from the eager calls (no host dispatch, like XLA's
command buffers); both are kept, and the report takes the faster. The first call of each
shape compiles QuACK's kernels (CuTe-DSL JIT) and is not timed.
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
from quack.rmsnorm import layernorm_bwd, layernorm_fwd

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TARGET_BYTES = 4e9
EPS = 1e-6  # the bench's
GRAPHS = {"on": True}
OPS = ("softmax", "rms_norm", "layer_norm", "cross_entropy")  # the bench's ops QuACK has


def inputs(op, m, n, dtype, count):
    """``count`` tuples of distinct arguments: x, the op's parameters or labels, dy."""

    def params(k):
        return tuple(torch.randn(n, device="cuda", dtype=torch.float32) for _ in range(k))

    extra = {
        "softmax": lambda: (),
        "rms_norm": lambda: params(1),
        "layer_norm": lambda: params(2),
        "cross_entropy": lambda: (torch.randint(0, n, (m,), device="cuda"),),
    }[op]
    return [
        (
            torch.randn(m, n, device="cuda", dtype=dtype),
            *extra(),
            torch.randn(m, n, device="cuda", dtype=dtype),
        )
        for _ in range(count)
    ]


def forward(op):
    return {
        "softmax": lambda x, dy: quack.softmax(x),
        "rms_norm": lambda x, w, dy: quack.rmsnorm(x, w, eps=EPS),
        "layer_norm": lambda x, w, b, dy: layernorm_fwd(x, w, b, eps=EPS),
        "cross_entropy": lambda x, labels, dy: quack.cross_entropy(x, labels),
    }[op]


def forward_backward(op):
    def softmax(x, dy):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(quack.softmax(x), x, dy)

    def rms_norm(x, w, dy):
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = quack.rmsnorm(x, w, eps=EPS)
        return y, torch.autograd.grad(y, (x, w), dy)

    def layer_norm(x, w, b, dy):
        y, rstd, mean = layernorm_fwd(x, w, b, eps=EPS, return_rstd=True, return_mean=True)
        return y, layernorm_bwd(x, w, dy, rstd, mean, has_bias=True)

    def cross_entropy(x, labels, dy):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(quack.cross_entropy(x, labels), x)

    return {
        "softmax": softmax,
        "rms_norm": rms_norm,
        "layer_norm": layer_norm,
        "cross_entropy": cross_entropy,
    }[op]


def median_seconds(launch_round, rounds, reps):
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(rounds):
            launch_round()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / rounds


def time_per_call(fn, args, reps):
    """Seconds per call: (eager, CUDA graph or None where capture failed)."""

    def eager():
        for a in args:
            fn(*a)

    eager()  # compiles the kernels; a second round settles the allocator
    eager()
    seconds = median_seconds(eager, 3, reps) / len(args)
    if not GRAPHS["on"]:
        return seconds, None
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            eager()
    except Exception as error:  # a failed capture can leave the stream unusable: stop trying
        print(f"  CUDA graph capture failed, eager only from here: {str(error)[:200]}")
        GRAPHS["on"] = False
        return seconds, None
    graph.replay()
    return seconds, median_seconds(graph.replay, 3, reps) / len(args)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--like", type=pathlib.Path, required=True, help="a bench --out folder")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    out = args.like / "quack_torch.json"
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    meta |= dict(quack=quack.__version__, cuda=torch.version.cuda)
    # a rerun keeps the rows already timed (a device call's time limit can cut a run short)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    done = {(r["op"], r["dtype"], r["m"], r["n"]) for r in rows}
    todo = []
    for op in OPS:
        path = args.like / f"{op}.json"
        if path.exists():
            bench = json.loads(path.read_text())
            todo += [(op, bench["meta"]["passes"], r) for r in bench["rows"]]
    todo.sort(key=lambda t: (t[2]["dtype"] != "bfloat16", t[0], t[2]["n"]))  # bf16 first
    for op, passes, r in todo:
        m, n, dtype = r["m"], r["n"], DTYPES[r["dtype"]]
        if (op, r["dtype"], m, n) in done:
            continue
        e = dtype.itemsize
        count = max(4, math.ceil(TARGET_BYTES / (2 * m * n * e)))
        data = inputs(op, m, n, dtype, count)
        row = dict(op=op, dtype=r["dtype"], m=m, n=n, k=count)
        for case, fn in (("fwd", forward(op)), ("fwd_bwd", forward_backward(op))):
            try:
                eager, graph = time_per_call(fn, data, args.reps)
            except Exception as error:  # recorded, and the report leaves the cell empty
                row[f"{case}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
                continue
            row[f"{case}_eager"], row[f"{case}_graph"] = eager, graph
            best = min(s for s in (eager, graph) if s is not None)
            row[f"{case}_tbps"] = passes[f"quack_{case}"] * m * n * e / best / 1e12
        rows.append(row)
        print(row, flush=True)
        out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        del data
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
