"""Linear + cross-entropy on the GPU: time, compiled memory and measured peak memory of
``loss = mean CE(h @ W, labels)`` with its gradients for h and W, one jitted
``value_and_grad``, bfloat16 h and W (d, V).

    python benchmarks/linear_ce.py --out DIR                      # every shape, the CE variants
    python benchmarks/linear_ce.py --out DIR --variants fused --chunks 1024 4096
    python benchmarks/linear_ce.py --out DIR --oom                # the out-of-memory row
    python benchmarks/linear_ce.py --out DIR --variants gemms logprobs_xla logprobs_fused
    python benchmarks/linear_ce.py --out DIR --sharded            # two GPUs, vocab-parallel

Variants (``--variants``):
  gemms            the three GEMMs alone (h @ W, then logits @ W.T and h.T @ logits): the
                   floor of any op that needs them
  xla              XLA: the logits upcast to float32, logsumexp minus the target logit
  unfused          h @ W, then quack_jax.cross_entropy
  fused            quack_jax.linear_cross_entropy (its default chunk; ``--chunks`` adds
                   fused@N rows with chunk_size=N)
  tokamax          tokamax.linear_softmax_cross_entropy_loss, implementation "xla"
  tokamax_chunked  the same, implementation "chunked_xla" (its loss is wrong where V is not
                   a multiple of its vocabulary block, 2048: it counts padded zero logits)
  logprobs_xla     an RL loss instead: ``mean(adv * logp + 0.01 * H)`` of the token
                   log-probs and entropies at temperature 0.7, in XLA (the logits in
                   float32, log_softmax of logits / T, a gather, -sum(p * logp))
  logprobs_fused   the same loss through quack_jax.linear_token_logprobs

Each (shape, variant) runs in a fresh process, so the peak device memory it reports
(``memory_stats()["peak_bytes_in_use"]``, the inputs included) is its own; the compiled
memory is ``memory_analysis()``'s temp and output bytes. Time: the median of ``--reps``
calls after one warm-up call (``input_peak_bytes`` is the peak after drawing the inputs,
before the variant runs). Children run with ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95``, so
"out of memory" means the card's memory, not JAX's default share of it. ``--oom`` runs the
xla and fused variants at OOM_SHAPE, where XLA's needs more than the card holds.

``--sharded`` (two or more GPUs) runs the fused op with the weight's vocabulary axis split
over all GPUs against the same inputs on one GPU: loss and gradients compared, both timed.

Results: DIR/linear_ce.json and linear_ce.md (and linear_ce.png with matplotlib);
linear_ce_oom.* with ``--oom``; linear_ce_sharded.json and .md with ``--sharded``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import quack_jax

GB = 1e9
# (tokens, hidden, vocabulary): Llama 3 8B, Gemma 2 2B, Qwen 2.5 7B heads, then twice the tokens
SHAPES = [(16384, 4096, 128256), (8192, 2304, 256000), (32768, 4096, 152064)]
SHAPES += [(2 * t, d, v) for t, d, v in SHAPES]
OOM_SHAPE = (196608, 4096, 152064)
SHARDED_SHAPES = [(16384, 4096, 128256), (8192, 2304, 256000)]
VARIANTS = ("gemms", "xla", "unfused", "fused", "tokamax", "tokamax_chunked")
LOGPROB_VARIANTS = ("logprobs_xla", "logprobs_fused")  # not run unless --variants names them
TEMPERATURE = 0.7
MEM_FRACTION = "0.95"


def loss_fn(variant: str):
    """loss(h, w, labels) of a variant, or None for the three GEMMs alone."""
    if variant == "xla":

        def loss(h, w, labels):
            logits = (h @ w).astype(jnp.float32)
            target = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)

        return loss
    if variant == "unfused":
        return lambda h, w, labels: quack_jax.cross_entropy(h @ w, labels)
    if variant.startswith("fused"):
        _, _, chunk = variant.partition("@")
        chunk = int(chunk) if chunk else None
        return lambda h, w, labels: quack_jax.linear_cross_entropy(h, w, labels, chunk_size=chunk)
    if variant.startswith("logprobs"):

        def logprobs(h, w, labels):
            if variant == "logprobs_fused":
                return quack_jax.linear_token_logprobs(
                    h, w, labels, temperature=TEMPERATURE, return_entropy=True
                )
            logp = jax.nn.log_softmax((h @ w).astype(jnp.float32) / TEMPERATURE, axis=-1)
            target = jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]
            return target, -jnp.sum(jnp.exp(logp) * logp, axis=-1)

        def loss(h, w, labels):
            logp, entropy = logprobs(h, w, labels)
            advantage = (labels % 3 - 1).astype(jnp.float32)  # any constant per token
            return jnp.mean(advantage * logp + 0.01 * entropy)

        return loss
    if variant.startswith("tokamax"):
        import tokamax

        impl = "chunked_xla" if variant == "tokamax_chunked" else "xla"
        return lambda h, w, labels: tokamax.linear_softmax_cross_entropy_loss(
            h, labels, w, reduction="mean", implementation=impl
        )
    return None


def step(variant: str):
    """(h, w, labels) -> (loss, (dh, dw)) of a variant, jitted."""
    loss = loss_fn(variant)
    if loss is None:  # the three GEMMs, with the logits standing in for their gradient

        def gemms(h, w, labels):
            logits = h @ w
            return jnp.zeros((), jnp.float32), (logits @ w.T, h.T @ logits)

        return jax.jit(gemms)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def inputs(t, d, v, seed=0):
    """h, W (logits of about unit size) and labels; jitted, so that drawing them holds no
    float32 or random-bits copy of W on the device."""
    kh, kw, kl = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(kh, (t, d), jnp.bfloat16)
    w = (jax.random.normal(kw, (d, v)) / np.sqrt(d)).astype(jnp.bfloat16)
    return h, w, jax.random.randint(kl, (t,), 0, v)


def timed(fn, args, reps):
    """Median seconds of ``reps`` calls after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def child(shape, variant, reps) -> dict:
    """One (shape, variant) in this process: its compiled memory, time and peak memory."""
    t, d, v = shape
    row = dict(t=t, d=d, v=v, variant=variant)
    try:
        args = jax.block_until_ready(inputs(t, d, v))
        row["input_peak_bytes"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
        fn = step(variant)
        compiled = fn.lower(*args).compile()
        memory = compiled.memory_analysis()
        row |= dict(temp_bytes=memory.temp_size_in_bytes, output_bytes=memory.output_size_in_bytes)
        row["kernels"] = compiled.as_text().count('custom_call_target="quack_jax_launch"')
        row["seconds"] = timed(compiled, args, reps)
        row["loss"] = float(compiled(*args)[0])
        row["peak_bytes"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
        row["input_bytes"] = sum(a.nbytes for a in args)
    except Exception as error:  # recorded: an out-of-memory row is a result here
        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    return row


def run_all(cases, reps, path: pathlib.Path) -> list:
    """Each case in a fresh process; the rows so far are written to ``path`` after each."""
    rows = []
    meta = dict(
        date=datetime.date.today().isoformat(),
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        mem_fraction=MEM_FRACTION,
    )
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=MEM_FRACTION)
    for shape, variant in cases:
        cmd = [sys.executable, __file__, "--child", variant, *map(str, shape), "--reps", str(reps)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = done.stdout.strip().splitlines()
        try:
            row = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            t, d, v = shape
            row = dict(t=t, d=d, v=v, variant=variant, error=done.stderr.strip()[-300:])
        rows.append(row)
        print(describe(row), flush=True)
        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return rows


def gigabytes(n) -> str:
    return "n/a" if n is None else f"{n / GB:.2f}"


def describe(row) -> str:
    head = f"{row['t']}x{row['d']}x{row['v']} {row['variant']:16s}"
    if "error" in row:
        return f"{head} error: {row['error'][:160]}"
    return (
        f"{head} {row['seconds'] * 1e3:8.2f} ms  temp {row['temp_bytes'] / GB:6.2f} GB  "
        f"temp+out {(row['temp_bytes'] + row['output_bytes']) / GB:6.2f} GB  "
        f"peak {gigabytes(row['peak_bytes'])} GB  kernels {row['kernels']}  loss {row['loss']:.5f}"
    )


def table(rows) -> str:
    """Markdown: per shape, each variant's time (and against the three GEMMs) and memory."""
    lines = [
        "| T x d x V | variant | time (ms) | / 3 GEMMs | temp (GB) | temp + out (GB) | peak (GB) "
        "| loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    gemms = {(r["t"], r["d"], r["v"]): r.get("seconds") for r in rows if r["variant"] == "gemms"}
    for r in rows:
        shape = f"{r['t']} x {r['d']} x {r['v']}"
        if "error" in r:
            lines.append(f"| {shape} | {r['variant']} | {r['error'][:80]} | | | | | |")
            continue
        base = gemms.get((r["t"], r["d"], r["v"]))
        ratio = f"{r['seconds'] / base:.3f}" if base else ""
        loss = "" if r["variant"] == "gemms" else f"{r['loss']:.4f}"
        lines.append(
            f"| {shape} | {r['variant']} | {r['seconds'] * 1e3:.1f} | {ratio} "
            f"| {r['temp_bytes'] / GB:.2f} | {(r['temp_bytes'] + r['output_bytes']) / GB:.2f} "
            f"| {gigabytes(r['peak_bytes'])} | {loss} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows, path: pathlib.Path):
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = list(dict.fromkeys((r["t"], r["d"], r["v"]) for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        got = {(r["t"], r["d"], r["v"]): r for r in rows if r["variant"] == variant}
        for ax, key in zip(axes, ("seconds", "peak_bytes"), strict=True):
            values = [got.get(s, {}).get(key, np.nan) for s in shapes]
            scale = 1e3 if key == "seconds" else 1 / GB
            xs = np.arange(len(shapes)) + i * width
            ax.bar(xs, np.asarray(values, float) * scale, width, label=variant)
    labels = [f"{t}x{d}x{v}" for t, d, v in shapes]
    for ax, title in zip(axes, ("time (ms)", "peak device memory (GB)"), strict=True):
        ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, labels, rotation=20, fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle("mean CE(h @ W) and its gradients, bf16, one H200")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sharded(shapes, reps, out: pathlib.Path):
    """The fused op with the vocabulary split over every GPU against one GPU."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("model",))
    fn = step("fused")
    rows = []
    for t, d, v in shapes:
        args = jax.device_put(inputs(t, d, v), devices[0])
        one_loss, (one_dh, one_dw) = fn(*args)
        split = jax.device_put(
            args,
            (
                NamedSharding(mesh, P()),
                NamedSharding(mesh, P(None, "model")),
                NamedSharding(mesh, P()),
            ),
        )
        loss, (dh, dw) = fn(*split)
        text = fn.lower(*split).compile().as_text()
        gathers = [c for c in ("all-gather", "all-to-all", "collective-permute") if c in text]
        diffs = {}
        for name, a, b in (("dh", dh, one_dh), ("dw", dw, one_dw)):
            a, b = (np.asarray(jax.device_get(x), np.float32) for x in (a, b))
            diffs |= {
                f"{name}_max_diff": float(np.abs(a - b).max()),
                f"{name}_max": float(np.abs(b).max()),
            }
        row = dict(
            t=t,
            d=d,
            v=v,
            devices=len(devices),
            loss_one=float(one_loss),
            loss_split=float(loss),
            **diffs,
            dw_spec=str(dw.sharding.spec),
            gathers=gathers,
            seconds_one=timed(fn, args, reps),
            seconds_split=timed(fn, split, reps),
        )
        rows.append(row)
        print(row, flush=True)
    (out / "linear_ce_sharded.json").write_text(json.dumps(dict(rows=rows), indent=1))
    (out / "linear_ce_sharded.md").write_text(sharded_table(rows))


def sharded_table(rows) -> str:
    lines = [
        "| T x d x V | GPUs | one GPU (ms) | vocab split (ms) | speedup | loss one / split "
        "| max diff dh / max dh | max diff dW / max dW | dW sharding |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['t']} x {r['d']} x {r['v']} | {r['devices']} | {r['seconds_one'] * 1e3:.1f} "
            f"| {r['seconds_split'] * 1e3:.1f} | {r['seconds_one'] / r['seconds_split']:.2f}x "
            f"| {r['loss_one']:.6f} / {r['loss_split']:.6f} "
            f"| {r['dh_max_diff']:.2e} / {r['dh_max']:.2e} | {r['dw_max_diff']:.2e} / "
            f"{r['dw_max']:.2e} | {r['dw_spec']} |"
        )
    return "\n".join(lines) + "\n"


def specs(t, d, v):
    """Shape-dtype structs of ``inputs(t, d, v)``."""
    return (
        jax.ShapeDtypeStruct((t, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
        jax.ShapeDtypeStruct((t,), jnp.int32),
    )


def prebuild_cases():
    """(fn, shape-dtype structs) whose kernels the GPU runs of this script launch."""
    for t, d, v in [*SHAPES, OOM_SHAPE]:
        yield loss_fn("unfused"), specs(t, d, v)
        yield jax.value_and_grad(loss_fn("unfused")), specs(t, d, v)
        yield jax.value_and_grad(loss_fn("fused"), argnums=(0, 1)), specs(t, d, v)
        yield jax.value_and_grad(loss_fn("logprobs_fused"), argnums=(0, 1)), specs(t, d, v)
    for t, d, v in SHARDED_SHAPES:
        # on two GPUs each chunk's slice of the vocabulary: its lse, then the backward kernel
        def per_row(logits, labels):
            return jnp.sum(quack_jax.cross_entropy(logits, labels, reduction="none"))

        yield (
            jax.grad(per_row),
            (jax.ShapeDtypeStruct((t, v // 2), jnp.bfloat16), specs(t, d, v)[2]),
        )


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + LOGPROB_VARIANTS
    )
    parser.add_argument("--chunks", nargs="*", type=int, default=[], help="fused@N rows")
    parser.add_argument("--shapes", nargs="*", type=int, help="T d V triples (default: SHAPES)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--oom", action="store_true", help="only the out-of-memory row")
    parser.add_argument("--sharded", action="store_true", help="vocab-parallel on every GPU")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # variant T d V
    args = parser.parse_args(argv)
    if args.child:
        variant, *shape = args.child
        print(json.dumps(child(tuple(map(int, shape)), variant, args.reps)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = SHARDED_SHAPES if args.sharded else SHAPES
    if args.shapes:
        shapes = [tuple(args.shapes[i : i + 3]) for i in range(0, len(args.shapes), 3)]
    if args.sharded:
        sharded(shapes, args.reps, args.out)
        return
    variants = list(args.variants) + [f"fused@{c}" for c in args.chunks]
    cases = [(s, v) for s in shapes for v in variants]
    name = "linear_ce"
    if args.oom:
        cases, name = [(OOM_SHAPE, v) for v in ("xla", "fused")], "linear_ce_oom"
    rows = run_all(cases, args.reps, args.out / f"{name}.json")
    (args.out / f"{name}.md").write_text(table(rows))
    plot(rows, args.out / f"{name}.png")
    print(table(rows))


if __name__ == "__main__":
    main()
