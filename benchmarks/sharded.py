"""Two GPUs against one: the per-device throughput of row-sharded ops and of the
vocab-parallel cross-entropy.

    python benchmarks/sharded.py --out DIR     # on a machine with two sm_90 GPUs

Rows: softmax, rms_norm and cross_entropy (quack_jax.bench's functions, forward and
forward+backward) on (2M, N) with the rows split over two GPUs, against (M, N) on one GPU.
Each GPU does the same work in both, so the ratio of the times is the ratio of the
per-device throughputs.

Vocabulary (cross-entropy, bfloat16, mean loss, forward and ``jax.grad``): (8192, 128256)
split over two GPUs by vocabulary, against the same array on one GPU (each GPU does half
the work), and (8192, 256512) split over two against (8192, 128256) on one (the same work
per GPU). The split loss and gradient are checked against one GPU's on the same array.

Timing as in bench.py (K distinct inputs in one jitted function, median of samples).
TB/s per device counts the bytes each GPU must move (bench.py's passes over its share).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import quack_jax
from quack_jax import bench
from quack_jax._report import tbps
from quack_jax._tiling import ITEMSIZE
from quack_jax._timing import describe, kernel_device, make_inputs, time_per_call

ROW_SHAPES = {"softmax": (16384, 4096), "rms_norm": (16384, 4096), "cross_entropy": (4096, 128256)}
VOCAB_ROWS, VOCAB = 8192, 128256
CASES = ("quack_fwd", "quack_fwd_bwd")


def _per_row_loss(logits, labels):
    return jnp.sum(quack_jax.cross_entropy(logits, labels, reduction="none"))


def prebuild_cases():
    """The kernels each GPU launches on its slice of the vocabulary (per-row forward and
    backward at V / 2 and V); the row-sharded runs launch bench.py's kernels."""
    labels = jax.ShapeDtypeStruct((VOCAB_ROWS,), jnp.int32)
    for n in (VOCAB // 2, VOCAB):
        yield jax.grad(_per_row_loss), (jax.ShapeDtypeStruct((VOCAB_ROWS, n), "bfloat16"), labels)


def _placed(arguments, mesh, by_rows: bool):
    """Each input array on the mesh: (M, N) arrays split by rows or by vocabulary, labels
    with the rows, weights replicated."""

    def spec(a):
        if a.ndim == 2:
            return PartitionSpec("g", None) if by_rows else PartitionSpec(None, "g")
        labels = a.dtype == jnp.int32
        return PartitionSpec("g") if labels and by_rows else PartitionSpec()

    return [tuple(jax.device_put(a, NamedSharding(mesh, spec(a))) for a in t) for t in arguments]


def _time(op, case, m, n, dtype, mesh=None, by_rows=True, reps=7):
    """Seconds per call of ``case`` on (m, n) inputs: on one GPU, or split on ``mesh``."""
    count = bench.input_count(op, m * n * ITEMSIZE[dtype] // (1 if mesh is None else 2))
    arguments = [a[: case.args] for a in make_inputs(op.arguments(m, n, dtype), count, m)]
    if mesh is not None:
        arguments = _placed(arguments, mesh, by_rows)
    seconds = time_per_call(case.fn, arguments, reps, require_kernel=True)
    del arguments
    return seconds


def rows_table(mesh, dtypes, reps):
    rows = []
    for dtype in dtypes:
        for name, (m, n) in ROW_SHAPES.items():
            op = bench.benchmarks()[name]
            for case in (c for c in op.cases if c.key in CASES):
                one = _time(op, case, m, n, dtype, reps=reps)
                two = _time(op, case, 2 * m, n, dtype, mesh, True, reps)
                nbytes = case.passes * m * n * ITEMSIZE[dtype]
                row = dict(op=name, case=case.key, dtype=dtype, m=m, n=n, bytes=nbytes)
                rows.append(row | dict(one=one, two=two))
                print(rows[-1], flush=True)
    return rows


def vocab_check(mesh):
    """The split loss and gradient against one GPU's, on one (8192, 128256) bf16 array."""
    op = bench.benchmarks()["cross_entropy"]
    logits, labels, _ = make_inputs(op.arguments(VOCAB_ROWS, VOCAB, "bfloat16"), 1, 7)[0]
    f = jax.jit(jax.value_and_grad(quack_jax.cross_entropy))
    split_loss, split_grad = f(*_placed([(logits, labels)], mesh, False)[0])
    loss, grad = f(logits, labels)
    diff = np.abs(np.asarray(split_grad, np.float32) - np.asarray(grad, np.float32))
    scale = float(np.abs(np.asarray(grad, np.float32)).max())
    return dict(
        loss_one=float(loss),
        loss_two=float(split_loss),
        grad_max_diff=float(diff.max()),
        grad_max=scale,
        grad_spec=str(split_grad.sharding.spec),
    )


def vocab_table(mesh, reps):
    op = bench.benchmarks()["cross_entropy"]
    rows = []
    for case in (c for c in op.cases if c.key in CASES):
        one = _time(op, case, VOCAB_ROWS, VOCAB, "bfloat16", reps=reps)
        half = _time(op, case, VOCAB_ROWS, VOCAB, "bfloat16", mesh, False, reps)
        same = _time(op, case, VOCAB_ROWS, 2 * VOCAB, "bfloat16", mesh, False, reps)
        nbytes = case.passes * VOCAB_ROWS * VOCAB * 2
        rows.append(dict(case=case.key, bytes=nbytes, one=one, split=half, split_double=same))
        print(rows[-1], flush=True)
    return rows


def report(rows, vocab, check) -> str:
    lines = [
        "Rows split over two GPUs ((2M, N)) against one GPU ((M, N)): TB/s per device.",
        "",
        "| op | dtype | M x N per GPU | case | one GPU | two GPUs | two / one |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['dtype']} | {r['m']}x{r['n']} | {r['case']} | "
            f"{tbps(r['bytes'], r['one']):.2f} | {tbps(r['bytes'], r['two']):.2f} | "
            f"{r['one'] / r['two']:.3f} |"
        )
    lines += [
        "",
        f"Vocab-parallel cross-entropy, bfloat16, {VOCAB_ROWS} rows, mean loss: milliseconds.",
        "",
        f"| case | one GPU, V={VOCAB} | two GPUs, V={VOCAB} | speedup | "
        f"two GPUs, V={2 * VOCAB} | per-device TB/s one / two (same work) |",
        "|---|---|---|---|---|---|",
    ]
    for r in vocab:
        lines.append(
            f"| {r['case']} | {1e3 * r['one']:.3f} | {1e3 * r['split']:.3f} | "
            f"{r['one'] / r['split']:.2f}x | {1e3 * r['split_double']:.3f} | "
            f"{tbps(r['bytes'], r['one']):.2f} / "
            f"{tbps(r['bytes'], r['split_double']):.2f} |"
        )
    lines += ["", f"Split against one GPU on the same array: {check}"]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dtypes", nargs="+", default=bench.DTYPES, choices=bench.DTYPES)
    args = parser.parse_args(argv)
    if len(jax.devices()) < 2 or not kernel_device():
        parser.error("needs two GPUs that run quack_jax kernels")
    mesh = jax.make_mesh((2,), ("g",), devices=jax.devices()[:2])
    check = vocab_check(mesh)
    print(check, flush=True)
    rows = rows_table(mesh, args.dtypes, args.reps)
    vocab = vocab_table(mesh, args.reps)
    header = f"sharded, {datetime.date.today()}, 2 x {describe()}, jax {jax.__version__}\n\n"
    text = header + report(rows, vocab, check)
    print(text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sharded.md").write_text(text + "\n")
        data = dict(rows=rows, vocab=vocab, check=check, date=str(datetime.date.today()))
        (args.out / "sharded.json").write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
