"""Where the time of ``linear_cross_entropy`` goes, on one GPU, in one process per shape:

    python benchmarks/profile_linear_ce.py --out DIR [--shapes T d V ...] [--chunks N ...]

For each shape (bfloat16 h and W (d, V), ``value_and_grad`` of the mean loss for h and W)
it times, in the same process, median of ``--reps`` calls after a warm-up:

- ``gemms``: the three GEMMs alone over the whole T (the floor); ``gemms_padded``: the
  same with the weight padded to a multiple of 64 columns;
- ``gemms_chunked@N``: the same three GEMMs in ``linear_cross_entropy``'s loop of chunks
  of N rows, dW accumulated in float32 over the chunks as the op does it, no
  cross-entropy: the cost of chunking and of the accumulator apart from the loss;
- ``unfused``: ``h @ W`` then ``quack_jax.cross_entropy``;
- ``fused`` (its default chunk) and ``fused@N``: ``quack_jax.linear_cross_entropy``.

Then one call of each is traced with ``jax.profiler`` and its device kernels summed by
kind: GEMMs (cuBLAS), quack_jax's kernels, XLA's fusions (by name), copies; the span of
the call on the device and the time in no kernel (gaps). The compiled HLO of ``fused``
tells whether XLA folded the dW accumulation into the GEMM (a cuBLAS call with beta = 1)
or left an add of its own. Results: DIR/profile_linear_ce.json and .md.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import pathlib
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import linear_ce
from device_trace import kernel_kind, traced_events

import quack_jax

SHAPES = [(16384, 4096, 128256), (8192, 2304, 256000)]
CHUNKS = (2048, 4096, 8192)
F32 = jnp.float32


def gemms_chunked(chunk: int):
    """The three GEMMs in chunks of ``chunk`` rows, dW accumulated in float32 over the
    chunks (the first writes it), dh written per chunk, as ``linear_cross_entropy`` does."""

    def fn(h, w, labels):
        t = h.shape[0]
        size = min(chunk, t)
        chunks = t // size

        def step(i, carry):
            dh, dw = carry
            hc = lax.dynamic_slice_in_dim(h, i * size, size)
            z = hc @ w
            dhc = lax.dot_general(
                z, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            dh = lax.dynamic_update_slice_in_dim(dh, dhc.astype(h.dtype), i * size, 0)
            dwc = lax.dot_general(
                hc, z, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            return dh, dw + dwc

        first = step(0, (jnp.zeros_like(h), jnp.zeros(w.shape, jnp.float32)))
        dh, dw = lax.fori_loop(1, chunks, step, first)
        return jnp.zeros((), jnp.float32), (dh, dw)

    return jax.jit(fn)


def gemms_padded(h, w, labels):
    """The three GEMMs with the weight padded to a multiple of 64 columns, as
    ``linear_cross_entropy`` pads a misaligned vocabulary."""
    v = w.shape[1]
    w = jnp.pad(w, ((0, 0), (0, -v % 64)))
    logits = h @ w
    return jnp.zeros((), jnp.float32), (logits @ w.T, (h.T @ logits)[:, :v])


def fused(chunk: int | None):
    def loss(h, w, labels):
        return quack_jax.linear_cross_entropy(h, w, labels, chunk_size=chunk)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def variants(chunks):
    out = {"gemms": linear_ce.step("gemms"), "gemms_padded": jax.jit(gemms_padded)}
    out["unfused"] = linear_ce.step("unfused")
    out |= {f"gemms_chunked@{c}": gemms_chunked(c) for c in chunks}
    out["fused"] = fused(None)
    out |= {f"fused@{c}": fused(c) for c in chunks}
    return out


def device_kernels(fn, args):
    """(name, start µs, duration µs) of every kernel one call runs, from a jax.profiler
    trace."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as folder:
        events = traced_events(lambda: jax.block_until_ready(fn(*args)), folder)
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in events if "dur" in e]


def breakdown(kernels) -> dict:
    """Device µs by kind, the call's span on the device, the gaps, the top kernels."""
    if not kernels:
        return {}
    by_kind = collections.Counter()
    by_name = collections.Counter()
    counts = collections.Counter()
    for name, _, dur in kernels:
        by_kind[kernel_kind(name) or "fusion"] += dur
        short = re.sub(r"\d+", "#", name)[:90]
        by_name[short] += dur
        counts[short] += 1
    start = min(s for _, s, _ in kernels)
    end = max(s + d for _, s, d in kernels)
    busy = sum(d for *_, d in kernels)
    return dict(
        span_us=end - start,
        busy_us=busy,
        gaps_us=end - start - busy,
        kernels=len(kernels),
        by_kind_us=dict(by_kind),
        top=[(n, round(us, 1), counts[n]) for n, us in by_name.most_common(12)],
    )


def hlo_facts(fn, args) -> dict:
    """What XLA made of the dW accumulation: its cuBLAS calls (with beta = 1, the GEMM
    adds into its output) and its fusions whose result is the float32 dW."""
    text = fn.lower(*args).compile().as_text()
    d, v = args[1].shape
    calls = re.findall(r'custom_call_target="(__cublas[^"]*)".*', text)
    beta1 = len(re.findall(r'"beta":1(?:\.0)?\b', text))
    dw_fusions = [
        line.strip()[:160]
        for line in text.splitlines()
        if re.search(rf"= f32\[{d},{v}\]\S* fusion\(", line)
    ]
    return dict(cublas_calls=len(calls), beta_one=beta1, dw_fusions=dw_fusions)


def profile(shape, chunks, reps) -> dict:
    t, d, v = shape
    args = jax.block_until_ready(linear_ce.inputs(t, d, v))
    out = dict(tokens=t, hidden=d, vocab=v, dtype="bfloat16", variants={})
    for name, fn in variants(chunks).items():
        row = {}
        try:
            compiled = fn.lower(*args).compile()
            memory = compiled.memory_analysis()
            row["temp_gb"] = memory.temp_size_in_bytes / 1e9
            row["ms"] = 1e3 * linear_ce.timed(compiled, args, reps)
            row["profile"] = breakdown(device_kernels(compiled, args))
            if name == "fused":
                row["hlo"] = hlo_facts(fn, args)
        except Exception as error:  # a row that fails is a result here
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        out["variants"][name] = row
        print(shape, name, json.dumps(row)[:400], flush=True)
    return out


HEADER = (
    "| variant | ms | / gemms | temp GB | gemm ms | quack_jax ms | fusions ms | copies ms "
    "| gaps ms |"
)


def table(results) -> str:
    lines = []
    for r in results:
        lines.append(f"\n## {r['tokens']} x {r['hidden']} x {r['vocab']} bf16\n")
        lines.append(HEADER)
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        floor = r["variants"].get("gemms", {}).get("ms")
        for name, row in r["variants"].items():
            if "error" in row:
                lines.append(f"| {name} | {row['error'][:80]} | | | | | | | |")
                continue
            p = row.get("profile", {})
            k = p.get("by_kind_us", {})
            cells = [f"{k.get(x, 0) / 1e3:.2f}" for x in ("gemm", "quack_jax", "fusion", "copy")]
            ratio = f"{row['ms'] / floor:.3f}" if floor else ""
            gaps = f"{p.get('gaps_us', 0) / 1e3:.2f}"
            lines.append(
                f"| {name} | {row['ms']:.2f} | {ratio} | {row['temp_gb']:.2f} | "
                + " | ".join(cells)
                + f" | {gaps} |"
            )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--shapes", nargs="*", type=int, help="T d V triples")
    parser.add_argument("--chunks", nargs="*", type=int, default=list(CHUNKS))
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(args.shapes[i : i + 3]) for i in range(0, len(args.shapes), 3)]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        date=datetime.date.today().isoformat(),
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
    )
    results = []
    for shape in shapes:
        results.append(profile(shape, args.chunks, args.reps))
        (args.out / "profile_linear_ce.json").write_text(
            json.dumps(dict(meta=meta, results=results), indent=1)
        )
        (args.out / "profile_linear_ce.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
