"""QuACK's chunked linear cross-entropy for PyTorch on ``linear_ce.py``'s shapes, timed the
same way: ``loss = mean CE(x @ W.T)`` and its gradients for x and W, bfloat16, median of
``--reps`` calls after one warm-up, with the peak memory PyTorch's allocator saw
(``torch.cuda.max_memory_allocated``, the inputs included).

    python benchmarks/quack_linear_ce.py --out DIR    # needs torch, CUDA and quack-kernels

Two rows per shape: ``quack`` (``chunked_linear_cross_entropy`` as it picks its path: on an
sm_90 GPU with bfloat16 it takes its scaled-exp pipeline where the shapes allow) and
``quack_plain`` (``use_scaled_exp=False``: the GEMM, the cross-entropy kernel writing
dlogits over the chunk's logits, two GEMMs, as linear_cross_entropy does), both at
QuACK's default chunk of 4096 rows. Results: DIR/quack_linear_ce.json and .md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch
from linear_ce import GB, SHAPES  # beside this script
from quack.linear_cross_entropy import chunked_linear_cross_entropy


def run(shape, scaled_exp, reps) -> dict:
    t, d, v = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(v, d, device="cuda", generator=gen) / d**0.5).to(torch.bfloat16)
    labels = torch.randint(0, v, (t,), device="cuda", generator=gen)
    x.requires_grad_(), w.requires_grad_()

    def step():
        loss = chunked_linear_cross_entropy(x, w, labels, use_scaled_exp=scaled_exp)
        return loss, *torch.autograd.grad(loss, (x, w))

    torch.cuda.reset_peak_memory_stats()
    loss = step()[0]
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return dict(
        seconds=statistics.median(times),
        loss=float(loss),
        peak_bytes=torch.cuda.max_memory_allocated(),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import quack

    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    meta |= dict(quack=quack.__version__)
    rows = []
    for shape in SHAPES:
        for variant, scaled_exp in (("quack", None), ("quack_plain", False)):
            t, d, v = shape
            row = dict(t=t, d=d, v=v, variant=variant)
            try:
                row |= run(shape, scaled_exp, args.reps)
            except Exception as error:  # recorded, as linear_ce.py records its own
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
            (args.out / "quack_linear_ce.json").write_text(
                json.dumps(dict(meta=meta, rows=rows), indent=1)
            )
    lines = [
        "| T x d x V | variant | time (ms) | peak (GB) | loss |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        shape = f"{r['t']} x {r['d']} x {r['v']}"
        if "error" in r:
            lines.append(f"| {shape} | {r['variant']} | {r['error'][:80]} | | |")
        else:
            peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / GB:.2f}"
            lines.append(
                f"| {shape} | {r['variant']} | {r['seconds'] * 1e3:.1f} | {peak} "
                f"| {r['loss']:.4f} |"
            )
    (args.out / "quack_linear_ce.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
