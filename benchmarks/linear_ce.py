"""Linear + cross-entropy on the GPU against its three GEMMs: for each shape and dtype,
every variant timed in one process, so that the ratios compare like with like.

    python benchmarks/linear_ce.py --out DIR                     # every row: both sets, dtypes
    python benchmarks/linear_ce.py --out DIR --sets ce --dtypes bfloat16 --shapes 16384 4096 128256
    python benchmarks/linear_ce.py --out DIR --oom               # the out-of-memory row
    python benchmarks/linear_ce.py --out DIR --sharded           # two GPUs, vocab-parallel

Variant sets (``--sets``), each the value and the gradients of h and W in one jit:
  ce    ``mean CE(h @ W, labels)``
  grpo  a GRPO-style policy loss ``mean(advantage * logp + 0.01 * entropy)`` of the
        tokens' log-probabilities and the rows' entropies at temperature 0.9

and in each set the variants:
  gemms       the three GEMMs alone (h @ W, then logits @ W.T and h.T @ logits): the floor
  fused       quack_jax.linear_cross_entropy (ce) or linear_token_logprobs (grpo), at its
              default chunk
  token_loss  (grpo only) quack_jax.linear_token_loss of the same per-token loss: its
              gradients in the forward pass, three GEMMs per chunk
  unfused     h @ W, then quack_jax.cross_entropy or token_logprobs
  xla      XLA: the logits in float32, logsumexp minus the target logit (ce), or
           log_softmax of logits / T, a gather and -sum(p * logp) (grpo)

Each (shape, dtype, set) runs in a fresh process (``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95``,
so that "out of memory" means the card's), which compiles each variant, then times it:
the median of ``--reps`` calls after one warm-up call. Its row in DIR/linear_ce.json has
``tokens``, ``hidden``, ``vocab``, ``dtype``, ``variant_set``, and per variant
``<variant>_ms``, ``<variant>_temp_gb`` (the compiled program's temporaries) and
``<variant>_loss``, or ``<variant>_error``; DIR/linear_ce.md is the table. ``--oom`` runs
xla and fused at OOM_SHAPE, where XLA's needs more than the card holds.

``--sharded`` (two or more GPUs) runs the fused op with the weight's vocabulary axis split
over all GPUs against the same inputs on one GPU: loss and gradients compared, both timed
(DIR/linear_ce_sharded.json and .md).
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
# (tokens, hidden, vocabulary): Llama 3 8B's, Gemma 2 2B's and Qwen 2.5 7B's heads, then
# twice their tokens; and each common vocabulary at 16384 tokens of 4096
TABLE = [(16384, 4096, 128256), (8192, 2304, 256000), (32768, 4096, 152064)]
TABLE += [(65536, 4096, 152064)]
SHAPES = list(dict.fromkeys(TABLE + [(2 * t, d, v) for t, d, v in TABLE]))
SHAPES += [(16384, 4096, v) for v in (32000, 50257, 152064, 256000)]
# Gemma 2 2B's head in 2048-row chunks; Llama 3 8B's at 4096 tokens, one chunk, whose
# backward takes the forward's logits (docs/decisions/025-one-chunk-keeps-its-logits.md)
GRPO_SHAPES = [(8192, 2304, 256000), (4096, 4096, 128256)]
DTYPES = ("bfloat16", "float32")
SETS = ("ce", "grpo")
VARIANTS = ("gemms", "fused", "token_loss", "unfused", "xla")
SET_VARIANTS = {"ce": ("gemms", "fused", "unfused", "xla"), "grpo": VARIANTS}
OOM_SHAPE = (196608, 4096, 152064)
SHARDED_SHAPES = [(16384, 4096, 128256), (8192, 2304, 256000)]
TEMPERATURE = 0.9
ENTROPY_BONUS = 0.01
MEM_FRACTION = "0.95"


def ce_loss(variant: str):
    """loss(h, w, labels) of a variant of the "ce" set."""
    if variant == "fused":
        return quack_jax.linear_cross_entropy
    if variant == "unfused":
        return lambda h, w, labels: quack_jax.cross_entropy(h @ w, labels)

    def xla(h, w, labels):
        logits = (h @ w).astype(jnp.float32)
        target = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)

    return xla


def grpo_loss(variant: str):
    """loss(h, w, labels) of a variant of the "grpo" set."""
    options = dict(temperature=TEMPERATURE, return_entropy=True)

    def advantages(labels):
        return (labels % 3 - 1).astype(jnp.float32)  # any constant per token

    if variant == "token_loss":

        def token_loss(h, w, labels):
            count = labels.shape[0]

            def per_token(logp, entropy, advantage):
                return (advantage * logp + ENTROPY_BONUS * entropy) / count

            return quack_jax.linear_token_loss(
                h, w, labels, per_token, advantages(labels), temperature=TEMPERATURE
            )

        return token_loss

    def logprobs(h, w, labels):
        if variant == "fused":
            return quack_jax.linear_token_logprobs(h, w, labels, **options)
        if variant == "unfused":
            return quack_jax.token_logprobs(h @ w, labels, **options)
        logp = jax.nn.log_softmax((h @ w).astype(jnp.float32) / TEMPERATURE, axis=-1)
        target = jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]
        return target, -jnp.sum(jnp.exp(logp) * logp, axis=-1)

    def loss(h, w, labels):
        logp, entropy = logprobs(h, w, labels)
        return jnp.mean(advantages(labels) * logp + ENTROPY_BONUS * entropy)

    return loss


def step(variant: str, variant_set: str = "ce"):
    """(h, w, labels) -> (loss, (dh, dw)) of a variant, jitted."""
    if variant == "gemms":  # the logits stand in for their gradient

        def gemms(h, w, labels):
            logits = h @ w
            return jnp.zeros((), jnp.float32), (logits @ w.T, h.T @ logits)

        return jax.jit(gemms)
    loss = (ce_loss if variant_set == "ce" else grpo_loss)(variant)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def inputs(t, d, v, dtype="bfloat16", seed=0):
    """h, W (logits of about unit size) and labels; jitted, so that drawing them holds no
    float32 or random-bits copy of W on the device."""
    kh, kw, kl = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(kh, (t, d), dtype)
    w = (jax.random.normal(kw, (d, v)) / np.sqrt(d)).astype(dtype)
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


def child(shape, dtype, variant_set, reps, variants=VARIANTS) -> dict:
    """One row in this process: each variant's compiled temporaries, time and loss."""
    t, d, v = shape
    row = dict(tokens=t, hidden=d, vocab=v, dtype=dtype, variant_set=variant_set)
    args = jax.block_until_ready(inputs(t, d, v, dtype))
    for variant in (v for v in variants if v in SET_VARIANTS[variant_set]):
        try:
            compiled = step(variant, variant_set).lower(*args).compile()
            row[f"{variant}_temp_gb"] = compiled.memory_analysis().temp_size_in_bytes / GB
            row[f"{variant}_ms"] = 1e3 * timed(compiled, args, reps)
            if variant != "gemms":
                row[f"{variant}_loss"] = float(compiled(*args)[0])
            del compiled
        except Exception as error:  # recorded: an out-of-memory variant is a result here
            row[f"{variant}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    return row | verdict(row)


def verdict(row) -> dict:
    """The targets a row is read against: fused within 1.03x of the GEMMs and no slower
    than unfused ("ce"); in "grpo", fused (``meets``) and token_loss (``token_loss_meets``)
    each no slower than XLA at a quarter of its memory or less."""
    ms = {k: row.get(f"{k}_ms") for k in VARIANTS}
    out = {}
    for mine in ("fused", "token_loss"):
        for other in ("gemms", "unfused", "xla"):
            if ms[mine] and ms[other]:
                out[f"{mine}_over_{other}"] = ms[mine] / ms[other]
    if row["variant_set"] == "ce" and {"fused_over_gemms", "fused_over_unfused"} <= out.keys():
        out["meets"] = out["fused_over_gemms"] <= 1.03 and out["fused_over_unfused"] <= 1.0
    if row["variant_set"] == "grpo":
        for mine, key in (("fused", "meets"), ("token_loss", "token_loss_meets")):
            if f"{mine}_over_xla" in out:
                small = row[f"{mine}_temp_gb"] <= row["xla_temp_gb"] / 4
                out[key] = out[f"{mine}_over_xla"] <= 1.0 and small
    return out


def run_all(cases, reps, path: pathlib.Path, variants=VARIANTS) -> list:
    """Each (shape, dtype, set) in a fresh process; the rows so far are written to
    ``path`` after each."""
    rows = []
    meta = dict(
        date=datetime.date.today().isoformat(),
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        mem_fraction=MEM_FRACTION,
        reps=reps,
    )
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=MEM_FRACTION)
    for shape, dtype, variant_set in cases:
        cmd = [sys.executable, __file__, "--child", dtype, variant_set, *map(str, shape)]
        cmd += ["--reps", str(reps), "--variants", *variants]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        try:
            row = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            t, d, v = shape
            row = dict(tokens=t, hidden=d, vocab=v, dtype=dtype, variant_set=variant_set)
            row["error"] = done.stderr.strip()[-300:]
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return rows


def table(rows) -> str:
    """Markdown: per row, each variant's time and temporaries, the fused op against the
    GEMMs, unfused and XLA, and whether it meets its targets (in "grpo": fused / the
    token loss)."""
    lines = [
        "| T x d x V | dtype | set | GEMMs ms | fused ms | token_loss ms | unfused ms "
        "| XLA ms | / GEMMs | / unfused | / XLA | temp GB fused / token_loss / unfused / XLA "
        "| meets |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        cells = [
            f"{r['tokens']} x {r['hidden']} x {r['vocab']}",
            r["dtype"],
            r["variant_set"],
        ]
        for v in VARIANTS:
            ran = v in SET_VARIANTS[r["variant_set"]]
            cells.append(f"{r[f'{v}_ms']:.2f}" if f"{v}_ms" in r else "failed" if ran else "-")
        for k in ("gemms", "unfused", "xla"):
            cells.append(f"{r[f'fused_over_{k}']:.3f}" if f"fused_over_{k}" in r else "-")
        temps = [r.get(f"{v}_temp_gb") for v in ("fused", "token_loss", "unfused", "xla")]
        cells.append(" / ".join("-" if x is None else f"{x:.2f}" for x in temps))
        meets = ("meets", "token_loss_meets") if r["variant_set"] == "grpo" else ("meets",)
        yes = {True: "yes", False: "no"}
        cells.append(" / ".join(yes.get(r.get(k), "-") for k in meets))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


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


def specs(t, d, v, dtype="bfloat16"):
    """Shape-dtype structs of ``inputs(t, d, v, dtype)``."""
    return (
        jax.ShapeDtypeStruct((t, d), dtype),
        jax.ShapeDtypeStruct((d, v), dtype),
        jax.ShapeDtypeStruct((t,), jnp.int32),
    )


def prebuild_cases():
    """(fn, shape-dtype structs) whose kernels the GPU runs of this script launch."""
    for (t, d, v), dtype in [(s, dt) for s in SHAPES for dt in DTYPES] + [(OOM_SHAPE, DTYPES[0])]:
        for variant in ("fused", "unfused"):
            yield jax.value_and_grad(ce_loss(variant), argnums=(0, 1)), specs(t, d, v, dtype)
    for (t, d, v), dtype in [(s, dt) for s in GRPO_SHAPES for dt in DTYPES]:
        for variant in ("fused", "token_loss", "unfused"):
            yield jax.value_and_grad(grpo_loss(variant), argnums=(0, 1)), specs(t, d, v, dtype)
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
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--shapes", nargs="*", type=int, help="T d V triples (default: SHAPES)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--oom", action="store_true", help="only the out-of-memory row")
    parser.add_argument("--sharded", action="store_true", help="vocab-parallel on every GPU")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)  # dtype set T d V
    args = parser.parse_args(argv)
    if args.child:
        dtype, variant_set, *shape = args.child
        row = child(tuple(map(int, shape)), dtype, variant_set, args.reps, args.variants)
        print(json.dumps(row))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sharded:
        sharded(SHARDED_SHAPES, args.reps, args.out)
        return
    shapes = {"ce": SHAPES, "grpo": GRPO_SHAPES}
    if args.shapes:
        given = [tuple(args.shapes[i : i + 3]) for i in range(0, len(args.shapes), 3)]
        shapes = dict.fromkeys(SETS, given)
    cases = [(s, d, vs) for vs in args.sets for s in shapes[vs] for d in args.dtypes]
    name, variants = "linear_ce", args.variants
    if args.oom:
        cases, name, variants = [(OOM_SHAPE, "bfloat16", "ce")], "linear_ce_oom", ["xla", "fused"]
    rows = run_all(cases, args.reps, args.out / f"{name}.json", variants)
    (args.out / f"{name}.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
