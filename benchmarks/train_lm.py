"""Train a decoder-only language model (flax.nnx) from the same seed on the same batches:
with stock Flax/optax layers, with quack_jax's, with quack_jax's and an LM head fused with
the loss, and with those and the residual stream's adds in the norms' kernels; and
compare the loss curves, the step time, tokens/s and the peak device memory (and, with
``--max-batch``, the largest batch that fits).

    python benchmarks/train_lm.py --config tiny --steps 20 --out DIR   # CPU, < 1 minute
    python benchmarks/train_lm.py --config h200 --steps 200 --out DIR  # one H200
    python benchmarks/train_lm.py --config llama3-1b --profile --max-batch --out DIR
    python benchmarks/train_lm.py --config h200 --devices 2 --out DIR  # data parallel
    python benchmarks/train_lm.py --config h200 --devices 2 --vocab-parallel 2 --out DIR
    python benchmarks/train_lm.py --config h200 --max-batch --out DIR  # and the batch limit

The model ("tiny", "h200"): token embedding, pre-norm blocks (RMSNorm, causal softmax
attention in plain JAX, RMSNorm, GELU MLP), a final RMSNorm and an untied LM head;
bfloat16 activations, float32 parameters, AdamW. The Llama configs ("llama3-1b": Llama
3.2-1B's shapes, d = 2048, 16 layers, 32 query and 8 key/value heads, SwiGLU of 8192, a
128256-token head tied to the embedding as the model ships; "llama3-1b-untied"; and
"llama-tiny", the same code at a CPU's size) take grouped-query attention with RoPE at
Llama 3's frequencies through ``jax.nn.dot_product_attention`` (cuDNN's flash attention
on a GPU), a SwiGLU MLP, and a tied head where the config says so.

The variants ("stock", "quack", "quack_jax_fused", "quack_jax_residual") share every line
but these: the norm class (``flax.nnx.RMSNorm``, or ``quack_jax.flax.nnx.RMSNorm`` in the
quack_jax variants), the attention softmax of the "tiny" and "h200" models
(``jax.nn.softmax`` in float32, or ``quack_jax.softmax``), the loss: optax's
``softmax_cross_entropy_with_integer_labels`` on float32 logits ("stock"),
``quack_jax.cross_entropy`` on the bfloat16 logits ("quack"), or the LM head and the
loss in one, ``quack_jax.flax.nnx.linear_cross_entropy(head, x, targets)``, which never
makes the (tokens, vocabulary) logits ("quack_jax_fused" and "quack_jax_residual"; a tied
head passes the ``nnx.Embed``); and the residual stream's add before each norm after the
first: ``h + delta`` then the norm, or (``"quack_jax_residual"``) ``norm(delta,
residual=h)``, one kernel for both, whose backward adds the stream's cotangent to dx in
the same pass.

The data is Python's own standard library source (the ``.py`` files of the running
interpreter's stdlib, nothing downloaded), tokenised by a word-level tokenizer built from
that text: the 256 bytes plus its most frequent pieces (words with their leading space,
runs of punctuation, runs of whitespace) up to the vocabulary size; a piece outside the
vocabulary is spelled in bytes. Batches are random windows, the same for every variant.

Each variant runs in its own process (so its peak memory is its own); the parent writes
``train_<config>.json`` (per-step loss and time, tokens/s, peak memory),
``train_<config>.md`` (the summary table) and ``train_<config>.png`` (the loss curves,
step times). ``--profile`` also traces a few steps of each variant in one more process
(with XLA's command buffers off, so that each kernel is tied to its instruction) and
reports the device time of each part of the model (by ``jax.named_scope``; the fused
variant's head and loss are one part, "lm_head_cross_entropy"), and by kernel kind
(``device_trace.KINDS``): GEMMs, attention, quack_jax's kernels, copies, and XLA's
fusions by the model part they compute.

``--max-batch``: before training, each variant's process also finds the largest batch
(sequences per step) whose jitted train step fits the device memory, without running
it: the step is compiled for abstract parameters, optimiser state and batch (nothing is
allocated), and its ``memory_analysis()`` (arguments + outputs + temporaries, less the
outputs that the donated parameters and optimiser state alias) is held against the
device's ``memory_stats()["bytes_limit"]``. From the config's batch, the search tries
where the line through the sizes found so far reaches the limit (a step's memory is
close to linear in its batch), bisecting where that guess fails, up to
``MAX_BATCH_CAP``, and finds the largest batch that fits in multiples of the
data-parallel size. A device without ``memory_stats``
(the CPU) cannot be judged: the search is skipped and says so. The result goes in the
JSON (each run's ``max_batch``) and in a column of the summary table. Near the limit XLA
rematerializes activations to fit, which makes the step slower than the one timed;
``--max-batch-no-remat`` judges each batch as XLA compiles it with room to spare
(``NO_REMAT``), so the batch found runs at the step time measured.

``--checkpoint-blocks`` puts each block under ``nnx.remat`` (``jax.checkpoint``), as
large-batch training does: the backward makes a block's activations again from its
input, so a step holds the residual stream of every block and one block's activations
at a time. Its files are named ``train_<config>_checkpointed.*``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np
from device_trace import kernel_kind, traced_events  # beside this script

VARIANTS = ("stock", "quack", "quack_jax_fused", "quack_jax_residual")
# quack_jax's norm and softmax
QUACK_VARIANTS = ("quack", "quack_jax_fused", "quack_jax_residual")
FUSED_VARIANTS = ("quack_jax_fused", "quack_jax_residual")  # the head and loss in one op
WARMUP = 5  # steps left out of the step time: compilation and the first launches
MAX_BATCH_CAP = 1 << 16  # --max-batch: the most sequences per step it tries
# --max-batch-no-remat: XLA's memory limit lifted (a percentage of the device's memory), so
# that it compiles the step as it would with room to spare, rematerializing nothing
NO_REMAT = {"xla_gpu_memory_limit_slop_factor": 1 << 20}


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    d: int
    layers: int
    heads: int
    seq: int
    batch: int  # sequences per step, over all devices
    lr: float
    corpus_mb: float | None = None  # read only this much of the stdlib (None: all)
    # "gpt": GELU MLP, softmax attention in plain JAX, untied head; "llama": SwiGLU,
    # grouped-query attention with RoPE (Llama 3's scaling) by jax.nn.dot_product_attention
    arch: str = "gpt"
    kv_heads: int | None = None  # llama: the key and value heads
    ffn: int | None = None  # llama: the SwiGLU's hidden size
    tied: bool = False  # the LM head is the embedding table: logits = x @ embedding.T
    # --checkpoint-blocks: each block under nnx.remat (jax.checkpoint), its activations made
    # again in the backward from the block's input, as large-batch training runs
    checkpoint_blocks: bool = False


# Llama 3.2-1B's shapes (the head tied to the embedding, as it ships, or untied), and a
# CPU-sized model of the same code for CI
LLAMA3_1B = dict(vocab=128256, d=2048, layers=16, heads=32, kv_heads=8, ffn=8192, arch="llama")
CONFIGS = {
    "tiny": Config(vocab=2048, d=64, layers=2, heads=4, seq=64, batch=8, lr=3e-3, corpus_mb=1),
    "h200": Config(vocab=131072, d=2048, layers=4, heads=16, seq=1024, batch=8, lr=3e-4),
    "llama3-1b": Config(**LLAMA3_1B, seq=1024, batch=8, lr=3e-4, tied=True),
    "llama3-1b-untied": Config(**LLAMA3_1B, seq=1024, batch=8, lr=3e-4),
    "llama-tiny": Config(
        vocab=2048,
        d=64,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=192,
        seq=64,
        batch=8,
        lr=3e-3,
        corpus_mb=1,
        arch="llama",
        tied=True,
    ),
}
# Llama 3's RoPE: base frequency, and the scaling of its long wavelengths
ROPE_THETA = 500000.0
ROPE_SCALING = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original=8192)


# -- data -------------------------------------------------------------------------------

PIECE = re.compile(r" ?\w+| ?[^\s\w]+|\s+")


def corpus(limit_mb: float | None) -> str:
    """The .py files of this interpreter's standard library, in path order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        f for f in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(f.parts)
    )
    texts, size = [], 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if limit_mb is not None and size >= limit_mb * 1e6:
            break
    return "\n\n".join(texts)


def tokenize(text: str, vocab: int) -> tuple[np.ndarray, int]:
    """Token ids of ``text`` and how many of the vocabulary's ids are pieces (after the 256
    bytes): the most frequent pieces, ties broken by the piece, fill the vocabulary."""
    pieces = PIECE.findall(text)
    counts = collections.Counter(pieces)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    table = {p: 256 + i for i, (p, _) in enumerate(ranked[: vocab - 256])}
    ids = []
    for p in pieces:
        i = table.get(p)
        if i is None:
            ids.extend(p.encode("utf-8"))
        else:
            ids.append(i)
    return np.asarray(ids, np.int32), len(table)


def cached_tokens(cfg: Config) -> tuple[np.ndarray, int]:
    """``tokenize(corpus(...))``, kept in the temporary folder for the next run."""
    key = f"{sys.version_info[0]}.{sys.version_info[1]}-{cfg.vocab}-{cfg.corpus_mb}"
    path = pathlib.Path(tempfile.gettempdir()) / f"quack_jax_train_tokens-{key}.npz"
    if path.exists():
        saved = np.load(path)
        return saved["tokens"], int(saved["pieces"])
    tokens, pieces = tokenize(corpus(cfg.corpus_mb), cfg.vocab)
    np.savez(path, tokens=tokens, pieces=pieces)
    return tokens, pieces


def batches(tokens: np.ndarray, cfg: Config, steps: int, seed: int):
    """(inputs, targets) of shape (batch, seq) for each step: random windows."""
    rng = np.random.default_rng(seed)
    span = np.arange(cfg.seq + 1)
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - cfg.seq - 1, cfg.batch)
        window = tokens[starts[:, None] + span]
        yield window[:, :-1], window[:, 1:]


# -- model ------------------------------------------------------------------------------


def rope(head_dim: int, seq: int):
    """Rotary position embedding with Llama 3's frequencies: x (batch, seq, heads,
    head_dim) -> x rotated by position, its halves as (real, imaginary) parts. The
    wavelengths longer than the original context's are stretched by ``factor``, those
    between the two thresholds blended (``ROPE_SCALING``)."""
    import jax.numpy as jnp

    sc = ROPE_SCALING
    inv = 1.0 / ROPE_THETA ** (np.arange(0, head_dim, 2) / head_dim)
    wavelength = 2 * np.pi / inv
    low, high = sc["original"] / sc["low_freq_factor"], sc["original"] / sc["high_freq_factor"]
    scaled = np.where(wavelength > low, inv / sc["factor"], inv)
    blend = (sc["original"] / wavelength - sc["low_freq_factor"]) / (
        sc["high_freq_factor"] - sc["low_freq_factor"]
    )
    medium = (wavelength >= high) & (wavelength <= low)
    inv = np.where(medium, (1 - blend) * scaled / sc["factor"] + blend * scaled, scaled)
    angles = np.arange(seq)[:, None] * inv[None, :]
    cos, sin = (np.asarray(f(angles), np.float32)[:, None, :] for f in (np.cos, np.sin))

    def rotary(x):
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        t = x.shape[1]
        c, s = cos[:t], sin[:t]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)

    return rotary


def build(cfg: Config, variant: str):
    """A function of the seed that makes the model, and the loss function, for ``variant``."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import quack_jax
    from quack_jax.flax import nnx as qnnx

    quack, fused = variant in QUACK_VARIANTS, variant in FUSED_VARIANTS
    residual = variant == "quack_jax_residual"
    norm_cls = qnnx.RMSNorm if quack else nnx.RMSNorm
    bf16, f32 = jnp.bfloat16, jnp.float32
    init = nnx.initializers.normal(0.02)

    def softmax(s):
        return quack_jax.softmax(s) if quack else jax.nn.softmax(s.astype(f32)).astype(bf16)

    def loss_of(logits, targets):
        if quack:
            return quack_jax.cross_entropy(logits, targets)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(f32), targets)
        return jnp.mean(losses)

    def linear(i, o, rngs):
        return nnx.Linear(
            i, o, use_bias=False, dtype=bf16, param_dtype=f32, kernel_init=init, rngs=rngs
        )

    def norm(rngs):
        return norm_cls(cfg.d, epsilon=1e-6, dtype=bf16, param_dtype=f32, rngs=rngs)

    def add_norm(norm, h, delta):
        """``(norm(h + delta), h + delta)``: the residual stream's add and the next norm
        (``delta`` None: the stream's first norm); in "quack_jax_residual" both in the
        norm's kernel, whose backward adds the stream's cotangent to dx."""
        if residual and delta is not None:
            return norm(delta, residual=h)
        h = h if delta is None else h + delta
        return norm(h), h

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1, self.norm2 = norm(rngs), norm(rngs)
            self.qkv, self.out = linear(cfg.d, 3 * cfg.d, rngs), linear(cfg.d, cfg.d, rngs)
            self.up, self.down = linear(cfg.d, 4 * cfg.d, rngs), linear(4 * cfg.d, cfg.d, rngs)

        def __call__(self, h, delta):
            b, t, _ = h.shape
            with jax.named_scope("norm"):
                x, h = add_norm(self.norm1, h, delta)
            with jax.named_scope("attention"):
                q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * cfg.heads, -1), 3, axis=2)
                s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
                s = jnp.where(jnp.tri(t, dtype=bool), s, -jnp.inf)
            with jax.named_scope("softmax"):
                p = softmax(s)
            with jax.named_scope("attention"):
                delta = self.out(jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, cfg.d))
            with jax.named_scope("norm"):
                x, h = add_norm(self.norm2, h, delta)
            with jax.named_scope("mlp"):
                return h, self.down(jax.nn.gelu(self.up(x)))

    class LlamaBlock(nnx.Module):
        def __init__(self, rngs):
            hd = cfg.d // cfg.heads
            self.norm1, self.norm2 = norm(rngs), norm(rngs)
            self.q = linear(cfg.d, cfg.heads * hd, rngs)
            self.kv = linear(cfg.d, 2 * cfg.kv_heads * hd, rngs)
            self.out = linear(cfg.heads * hd, cfg.d, rngs)
            self.gate_up = linear(cfg.d, 2 * cfg.ffn, rngs)
            self.down = linear(cfg.ffn, cfg.d, rngs)

        def __call__(self, h, delta):
            b, t, _ = h.shape
            with jax.named_scope("norm"):
                x, h = add_norm(self.norm1, h, delta)
            with jax.named_scope("attention"):
                q = self.q(x).reshape(b, t, cfg.heads, -1)
                k, v = jnp.split(self.kv(x).reshape(b, t, 2 * cfg.kv_heads, -1), 2, axis=2)
                q, k = rotary(q), rotary(k)
                a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
                delta = self.out(a.reshape(b, t, -1))
            with jax.named_scope("norm"):
                x, h = add_norm(self.norm2, h, delta)
            with jax.named_scope("mlp"):
                gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
                return h, self.down(jax.nn.silu(gate) * up)

    def call_block(block, h, delta):
        return block(h, delta)

    run_block = nnx.remat(call_block) if cfg.checkpoint_blocks else call_block
    llama = cfg.arch == "llama"
    if llama:
        rotary = rope(cfg.d // cfg.heads, cfg.seq)
        attention = "cudnn" if jax.default_backend() == "gpu" else None

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(
                cfg.vocab, cfg.d, dtype=bf16, param_dtype=f32, embedding_init=init, rngs=rngs
            )
            block = LlamaBlock if llama else Block
            self.blocks = nnx.List([block(rngs) for _ in range(cfg.layers)])
            self.norm = norm(rngs)
            self.head = self.embed if cfg.tied else linear(cfg.d, cfg.vocab, rngs)

        def features(self, tokens):
            """The LM head's input: the final norm of the residual stream, each block
            adding its attention's and its MLP's outputs (``delta``) to it."""
            h, delta = self.embed(tokens), None
            for block in self.blocks:
                h, delta = run_block(block, h, delta)
            with jax.named_scope("norm"):
                return add_norm(self.norm, h, delta)[0]

        def __call__(self, tokens):
            x = self.features(tokens)
            with jax.named_scope("lm_head"):
                return self.embed.attend(x) if cfg.tied else self.head(x)

    def make(seed):
        return LM(nnx.Rngs(seed))

    def loss_fn(params, graphdef, inputs, targets):
        model = nnx.merge(graphdef, params)
        if fused:  # the head's GEMMs and the loss in one op, without the logits
            x = model.features(inputs)
            with jax.named_scope("lm_head_cross_entropy"):
                return qnnx.linear_cross_entropy(model.head, x, targets)  # Embed if tied
        logits = model(inputs)
        with jax.named_scope("cross_entropy"):
            return loss_of(logits.reshape(-1, cfg.vocab), targets.reshape(-1))

    return make, loss_fn


def variant_grad(cfg: Config, variant: str):
    """A function of (params, inputs, targets), the gradient of ``variant``'s loss, and
    its abstract parameters (none are made)."""
    import jax
    from flax import nnx

    make, loss_fn = build(cfg, variant)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: make(0)), nnx.Param)

    def grad(params, inputs, targets):
        return jax.grad(loss_fn)(params, graphdef, inputs, targets)

    return grad, params


def prebuild_cases():
    """The quack_jax variants' gradients at the Llama and h200 configs (abstract: no
    parameters are made), for ``prebuild.py``: their kernels are the ones the training runs launch
    (``--max-batch`` changes the rows only, not the kernels)."""
    import jax

    import quack_jax

    for name in ("llama3-1b", "llama3-1b-untied"):
        cfg = CONFIGS[name]
        tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), "int32")
        for variant in QUACK_VARIANTS:
            grad, params = variant_grad(cfg, variant)
            yield grad, (params, tokens, tokens)
    cfg = CONFIGS["h200"]
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), "int32")
    grad, params = variant_grad(cfg, "quack")
    yield grad, (params, tokens, tokens)
    # --vocab-parallel 2: each device's slice of the logits goes through the per-row
    # forward (its lse) and the backward kernels
    half = jax.ShapeDtypeStruct((cfg.batch * cfg.seq, cfg.vocab // 2), "bfloat16")
    labels = jax.ShapeDtypeStruct((cfg.batch * cfg.seq,), "int32")
    per_row = jax.grad(lambda x, y: quack_jax.cross_entropy(x, y, reduction="none").sum())
    yield per_row, (half, labels)
    # quack_jax_fused: linear_cross_entropy's chunks of the whole vocabulary go through
    # the forward that writes the gradient in place of the logits
    grad, params = variant_grad(cfg, "quack_jax_fused")
    yield grad, (params, tokens, tokens)
    # quack_jax_fused with --vocab-parallel 2: each device's chunks of its (d, V/2) slice
    # go through the forward without the gradient (the slice's lse) and the backward
    # written in place, as linear_cross_entropy's per-row loss on one device launches
    h = jax.ShapeDtypeStruct((cfg.batch * cfg.seq, cfg.d), "bfloat16")
    w = jax.ShapeDtypeStruct((cfg.d, cfg.vocab // 2), "bfloat16")

    def per_row_loss(h, w, y):
        return quack_jax.linear_cross_entropy(h, w, y, reduction="none").sum()

    yield jax.grad(per_row_loss, argnums=(0, 1)), (h, w, labels)


def setup(cfg, variant, steps, devices, seed, vocab_parallel, abstract=False):
    """``variant``'s parameters and AdamW state placed on ``devices`` devices (data
    parallel, the LM head split by vocabulary over ``vocab_parallel`` of them), its jitted
    train step (parameters and optimiser state donated) and the batch's sharding. With
    ``abstract`` the parameters and state are ``jax.ShapeDtypeStruct`` of the shapes,
    dtypes and shardings that the real ones have: nothing is made or allocated."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    make, loss_fn = build(cfg, variant)
    model = nnx.eval_shape(lambda: make(seed)) if abstract else make(seed)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, cfg.lr, 20, max(steps, 21)))
    mesh = jax.make_mesh(
        (devices // vocab_parallel, vocab_parallel),
        ("data", "model"),
        axis_types=(AxisType.Auto,) * 2,
        devices=jax.devices()[:devices],
    )
    by_rows = NamedSharding(mesh, PartitionSpec("data"))

    def placement(path, _):
        head = any(getattr(k, "key", None) == "head" for k in path)
        return NamedSharding(mesh, PartitionSpec(None, "model") if head else PartitionSpec())

    shardings = jax.tree_util.tree_map_with_path(placement, params)
    if abstract:

        def like(a, sharding):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

        params = jax.tree.map(like, params, shardings)
        # no sharding: jax.jit(tx.init) makes the real state uncommitted, which leaves its
        # placement to the step's compilation
        opt_state = jax.eval_shape(tx.init, params)
    else:
        params = jax.device_put(params, shardings)
        opt_state = jax.jit(tx.init)(params)

    @jax.jit(donate_argnums=(0, 1))
    def step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, graphdef, inputs, targets)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

    return params, opt_state, step, by_rows


def train(
    cfg: Config,
    variant: str,
    steps: int,
    devices: int,
    seed: int,
    vocab_parallel=1,
    profile_dir=None,
):
    """Train one variant on ``devices`` devices: data parallel, with the LM head (and so
    the logits) split by vocabulary over ``vocab_parallel`` of them. Returns the record
    (per-step loss and seconds, peak memory)."""
    import jax

    import quack_jax
    from quack_jax._primitive import kernel_arch

    params, opt_state, step, by_rows = setup(cfg, variant, steps, devices, seed, vocab_parallel)
    tokens, pieces = cached_tokens(cfg)
    losses, seconds = [], []
    bar = Progress(steps, variant)
    for inputs, targets in batches(tokens, cfg, steps, seed):
        inputs, targets = (jax.device_put(a, by_rows) for a in (inputs, targets))
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, inputs, targets)
        losses.append(float(loss))
        seconds.append(time.perf_counter() - start)
        bar.update(losses[-1], cfg.batch * cfg.seq / seconds[-1])
    bar.close()
    shares = kinds = None
    if profile_dir is not None:
        state = [params, opt_state]

        def one_step():
            state[0], state[1], loss = step(*state, inputs, targets)
            return loss

        text = step.lower(*state, inputs, targets).compile().as_text()
        shares, kinds = profile(one_step, text, profile_dir)
    stats = [d.memory_stats() or {} for d in jax.devices()[:devices]]
    steady = seconds[WARMUP:] or seconds
    return dict(
        variant=variant,
        device=f"{devices} x {jax.devices()[0].device_kind}",
        mesh=dict(by_rows.mesh.shape),
        kernels=kernel_arch(jax.devices()[0]) is not None,
        jax=jax.__version__,
        quack_jax=quack_jax.__version__,
        corpus_tokens=len(tokens),
        vocab_pieces=pieces,
        loss=losses,
        seconds=seconds,
        step_seconds=statistics.median(steady),
        tokens_per_s=cfg.batch * cfg.seq / statistics.median(steady),
        peak_bytes=max((s.get("peak_bytes_in_use", 0) for s in stats), default=None) or None,
        profile=shares,
        profile_kinds=kinds,
    )


def step_bytes(compiled) -> dict:
    """What a compiled step needs on a device, from its ``memory_analysis()``: arguments,
    outputs and temporaries, less the outputs that alias donated arguments."""
    m = compiled.memory_analysis()
    parts = {
        k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
        for k in ("argument", "output", "temp", "alias", "generated_code")
    }
    parts["total"] = parts["argument"] + parts["output"] + parts["temp"] - parts["alias"]
    return parts


def largest(need, limit: int, start: int, unit: int, cap: int) -> tuple[int, bool]:
    """The largest multiple of ``unit`` whose ``need(batch)`` (bytes, growing with the
    batch; None: it cannot be built) is at most ``limit``, and whether ``cap`` stopped
    the search. The batches tried: ``start`` (a multiple of ``unit``), then where the
    line through the two nearest sizes known reaches ``limit`` (a step's memory is close
    to linear in its batch, so this takes a few compilations), within the bounds found so
    far, bisecting when that guess is not inside them; doubling while only one size is
    known. At most ``cap``; 0 where not even ``unit`` fits."""
    sizes = {}
    lo, hi, batch = 0, None, start  # lo fits (0: none yet), hi does not
    while True:
        sizes[batch] = need(batch)
        if sizes[batch] is not None and sizes[batch] <= limit:
            lo = batch
        else:
            hi = batch
        if hi is None and lo >= cap:
            return lo, True
        if hi is not None and hi - lo <= unit:
            return lo, False
        batch = _next_batch(sizes, limit, lo, hi, unit, cap)


def _next_batch(sizes, limit, lo, hi, unit, cap) -> int:
    """The next batch ``largest`` tries: the linear guess from the two sizes nearest the
    limit, moved inside the bounds (above ``lo``, below ``hi`` or at most ``cap``); with
    no guess (one size known, or a curve that the failures make flat), double ``lo`` or
    bisect."""
    near = sorted(
        ((b, n) for b, n in sizes.items() if n is not None), key=lambda bn: abs(bn[1] - limit)
    )
    top = cap if hi is None else hi - unit
    if len(near) >= 2 and near[0][1] != near[1][1]:
        (b0, n0), (b1, n1) = near[:2]
        guess = int(b0 + (limit - n0) * (b1 - b0) / (n1 - n0)) // unit * unit
        return min(max(guess, lo + unit), top)
    if hi is None:
        return min(2 * lo, cap)
    return max((lo + hi) // 2 // unit * unit, lo + unit)


def max_batch(
    cfg: Config,
    variant: str,
    devices: int,
    seed: int,
    vocab_parallel=1,
    limit=None,
    start=None,
    remat=True,
) -> dict:
    """The largest batch (sequences per step, a multiple of the data-parallel size) whose
    jitted train step fits the device memory, judged from the compiled step's memory
    analysis against ``limit`` (default: the device's ``memory_stats()["bytes_limit"]``);
    the step never runs. See ``largest`` for the search (from ``start``, default
    ``cfg.batch``, at most
    ``MAX_BATCH_CAP``). ``remat=False``: each step compiled with ``NO_REMAT``, which
    keeps XLA from rematerializing to fit. Returns the record: ``batch`` (None where it
    cannot judge, with ``reason``), ``bytes`` (its step's ``step_bytes``), ``limit``,
    ``remat``, ``capped``, ``unit`` and the ``step_bytes`` of every batch tried."""
    import jax

    device = jax.devices()[0]
    if limit is None:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    if not limit:
        reason = (
            f"the {device.platform} device reports no memory_stats()['bytes_limit']: cannot "
            "judge which batch fits, skipped"
        )
        print(f"{variant}: --max-batch: {reason}", file=sys.stderr, flush=True)
        return dict(batch=None, reason=reason)
    params, opt_state, step, by_rows = setup(
        cfg, variant, 1, devices, seed, vocab_parallel, abstract=True
    )
    unit = devices // vocab_parallel  # the batch is split over the data axis
    tried = {}

    def need(batch: int) -> int | None:
        tokens = jax.ShapeDtypeStruct((batch, cfg.seq), "int32", sharding=by_rows)
        start = time.perf_counter()
        try:
            lowered = step.lower(params, opt_state, tokens, tokens)
            found = step_bytes(lowered.compile(None if remat else NO_REMAT))
        except jax.errors.JaxRuntimeError as e:  # e.g. autotuning ran out of memory
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            found = dict(total=None, error=str(e).splitlines()[0][:200])
        tried[batch] = found
        total = found["total"]
        ok = total is not None and total <= limit
        size = "?" if total is None else f"{total / 2**30:.2f}"
        print(
            f"{variant}: batch {batch}: {size} of {limit / 2**30:.2f} GiB, "
            f"{'fits' if ok else 'does not fit'} ({time.perf_counter() - start:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        return total

    lo, capped = largest(need, limit, start or cfg.batch, unit, MAX_BATCH_CAP)
    return dict(
        batch=lo,
        tokens=lo * cfg.seq,
        bytes=tried.get(lo),
        limit=limit,
        remat=remat,
        capped=capped,
        unit=unit,
        tried={str(b): t for b, t in sorted(tried.items())},
    )


class Progress:
    """One line: a bar, the step, the loss and tokens/s, redrawn in place."""

    def __init__(self, total: int, label: str, width: int = 30):
        self.total, self.label, self.width, self.done = total, label, width, 0

    def update(self, loss: float, tokens_per_s: float):
        self.done += 1
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        print(
            f"\r{self.label:6s} [{bar}] {self.done}/{self.total} loss {loss:.4f} "
            f"{tokens_per_s:,.0f} tok/s",
            end="",
            file=sys.stderr,
            flush=True,
        )

    def close(self):
        print(file=sys.stderr, flush=True)


# -- profile ----------------------------------------------------------------------------

SCOPES = (
    "softmax",
    "cross_entropy",
    "norm",
    "attention",
    "mlp",
    "lm_head",
    "lm_head_cross_entropy",  # quack_jax_fused: the head's GEMMs and the loss in one op
    "optimizer",
)
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = .*metadata=\{[^}]*op_name=\"([^\"]+)\"")


def scope_of(op_name: str) -> str:
    """The innermost of SCOPES in a JAX op name path (the backward pass keeps the
    forward's scopes), or "other"."""
    found = [w for w in re.findall(r"[A-Za-z_]+", op_name) if w in SCOPES]
    return found[-1] if found else "other"


def profile(one_step, compiled_text: str, log_dir, steps: int = 3) -> dict:
    """Device time per model part over ``steps`` steps, from a JAX profiler trace: each
    device event's HLO instruction is looked up in the compiled program for its op name."""
    import jax

    scopes = {}
    for m in map(INSTRUCTION.match, compiled_text.splitlines()):
        if m:  # kernels are named after their instruction, with "_" for "."
            scopes[m.group(1)] = scopes[m.group(1).replace(".", "_")] = scope_of(m.group(2))
    timed = traced_events(
        lambda: jax.block_until_ready([one_step() for _ in range(steps)]), log_dir
    )
    totals, kinds = collections.Counter(), collections.Counter()
    for e in timed:
        args = e.get("args", {})
        names = (args.get("hlo_op"), e.get("name"), args.get("long_name", "").split(" = ")[0])
        part = next((scopes[n] for n in names if n in scopes), scope_of(args.get("tf_op", "")))
        totals[part] += e.get("dur", 0.0)
        kinds[kernel_kind(e.get("name", "")) or f"fusion: {part}"] += e.get("dur", 0.0)
    whole = sum(totals.values()) or 1.0
    busy = max(len({e.get("pid") for e in timed}), 1)  # devices that ran the steps

    def shares(counts):
        return {
            k: dict(us_per_step=v / steps / busy, share=v / whole) for k, v in counts.most_common()
        }

    return shares(totals), shares(kinds)


# -- driver -----------------------------------------------------------------------------


def plot(records: dict, cfg_name: str, path: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for variant, r in records.items():
        label = f"{variant} ({r['tokens_per_s']:,.0f} tok/s)"
        ax1.plot(r["loss"], label=label, alpha=0.8)
        ax2.plot(np.asarray(r["seconds"][WARMUP:]) * 1e3, label=variant, alpha=0.8)
    first = next(iter(records.values()))
    ax1.set(xlabel="step", ylabel="train loss", title=f"{cfg_name}: {first['device']}")
    ax2.set(xlabel=f"step (after {WARMUP})", ylabel="step time (ms)", title="step time")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def max_batch_cell(found: dict) -> str:
    """The summary's cell for a ``max_batch`` record."""
    if found["batch"] is None:
        return "-"
    size = "" if found["bytes"] is None else f" ({found['bytes']['total'] / 2**30:.2f} GiB)"
    return f"{'>= ' if found['capped'] else ''}{found['batch']}{size}"


def against(name: str, seconds: float, stock: float) -> str:
    """``name``'s step time beside stock's, and which is faster by how much."""
    ratio = (
        f"{stock / seconds:.2f}x faster" if seconds <= stock else f"{seconds / stock:.2f}x slower"
    )
    return f"{name} {1e3 * seconds:.2f} ms/step, stock {1e3 * stock:.2f} ms/step: {name} {ratio}"


def summary(records: dict) -> str:
    searched = [r["max_batch"] for r in records.values() if "max_batch" in r]
    lines = [
        "| variant | step (ms) | tokens/s | peak memory (GiB) | final loss |"
        + (" max batch (sequences) |" if searched else ""),
        "|---|---|---|---|---|" + ("---|" if searched else ""),
    ]
    for v, r in records.items():
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}"
        lines.append(
            f"| {v} | {1e3 * r['step_seconds']:.2f} | {r['tokens_per_s']:,.0f} | {peak} | "
            f"{r['loss'][-1]:.4f} |"
            + (f" {max_batch_cell(r['max_batch'])} |" if "max_batch" in r else "")
        )
    if searched:
        judged = [m for m in searched if m["batch"] is not None]
        if judged:
            lines.append(
                f"\nmax batch: the most sequences per step whose compiled train step's "
                f"arguments + outputs + temporaries - donated aliases fit the device's "
                f"bytes_limit ({judged[0]['limit'] / 2**30:.2f} GiB), in multiples of "
                f"{judged[0]['unit']} (the step was compiled, never run"
                + ("" if judged[0]["remat"] else ", XLA kept from rematerializing")
                + ")"
            )
        else:
            lines.append(f"\nmax batch: not searched: {searched[0]['reason']}")
    against_stock = [
        against(name, records[variant]["step_seconds"], records["stock"]["step_seconds"])
        for variant, name in (("quack", "quack_jax"), *((v, v) for v in FUSED_VARIANTS))
        if {"stock", variant} <= records.keys()
    ]
    if against_stock:
        lines.append("\n" + "\n".join(against_stock))
    for key, title, rows in (
        ("profile", "model part", (*SCOPES, "other")),
        ("profile_kinds", "kernel kind", None),
    ):
        profiled = {v: r[key] for v, r in records.items() if r.get(key)}
        if not profiled:
            continue
        if rows is None:  # every kind any variant ran, the longest first
            rows = sorted(
                {k for p in profiled.values() for k in p},
                key=lambda k: -max(p.get(k, {}).get("us_per_step", 0) for p in profiled.values()),
            )
        lines += ["", f"Device time per step by {title}, ms (share of the step):", ""]
        lines += [f"| {title} | " + " | ".join(profiled) + " |"]
        lines += ["|---" * (len(profiled) + 1) + "|"]
        for row in rows:
            cells = [
                f"{p[row]['us_per_step'] / 1e3:.2f} ({100 * p[row]['share']:.1f}%)"
                if row in p
                else "-"
                for p in profiled.values()
            ]
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_child(args, variant: str, steps: int, extra=(), **env) -> dict:
    """Train ``variant`` in a process of its own; returns its record."""
    record = args.out / f".train_{args.config}_{variant}.json"
    child = [sys.executable, __file__, "--record", str(record), "--variants", variant]
    child += ["--config", args.config, "--steps", str(steps)]
    child += ["--devices", str(args.devices), "--vocab-parallel", str(args.vocab_parallel)]
    child += ["--seed", str(args.seed), *extra]
    child += ["--checkpoint-blocks"] if args.checkpoint_blocks else []
    subprocess.run(child, check=True, env=os.environ | env)
    result = json.loads(record.read_text())
    record.unlink()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", choices=list(CONFIGS), default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--devices", type=int, default=1, help="data parallel over this many")
    parser.add_argument(
        "--vocab-parallel", type=int, default=1, help="split the LM head over this many"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--profile", action="store_true", help="trace a few steps per variant")
    parser.add_argument(
        "--max-batch",
        action="store_true",
        help="also find each variant's largest batch (sequences per step) whose compiled "
        "train step fits the device's memory (memory_analysis against "
        "memory_stats()['bytes_limit'], without running it); skipped where the device "
        "reports no memory_stats (the CPU)",
    )
    parser.add_argument(
        "--max-batch-start",
        type=int,
        help="the batch --max-batch starts its search from (default: the config's batch), "
        "a multiple of the data-parallel size",
    )
    parser.add_argument(
        "--max-batch-no-remat",
        action="store_true",
        help="--max-batch: judge each batch as XLA compiles it with room to spare, where it "
        "does not rematerialize activations to fit (the batch found runs at the step time "
        "measured)",
    )
    parser.add_argument(
        "--checkpoint-blocks",
        action="store_true",
        help="checkpoint each block (nnx.remat): the backward makes its activations again "
        "from the block's input, which keeps one block's activations alive at a time",
    )
    parser.add_argument("--record", type=pathlib.Path, help=argparse.SUPPRESS)  # a child run
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(CONFIGS[args.config], checkpoint_blocks=args.checkpoint_blocks)
    if args.record:
        (variant,) = args.variants
        profile_dir = tempfile.mkdtemp() if args.profile else None
        found = None
        if args.max_batch:  # first: the default chunk of linear_cross_entropy follows the
            # free memory, which training would take
            found = max_batch(
                cfg,
                variant,
                args.devices,
                args.seed,
                args.vocab_parallel,
                start=args.max_batch_start,
                remat=not args.max_batch_no_remat,
            )
        result = train(
            cfg, variant, args.steps, args.devices, args.seed, args.vocab_parallel, profile_dir
        )
        if found is not None:
            result["max_batch"] = found
        args.record.write_text(json.dumps(result))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    records = {}
    for variant in args.variants:
        search = ["--max-batch"] if args.max_batch else []
        if args.max_batch and args.max_batch_start:
            search += ["--max-batch-start", str(args.max_batch_start)]
        if args.max_batch and args.max_batch_no_remat:
            search += ["--max-batch-no-remat"]
        records[variant] = run_child(args, variant, args.steps, search)
        if args.profile:  # traced apart, without XLA's command buffers (CUDA graphs), whose
            # kernels the trace cannot tie to the program's instructions
            flags = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
            traced = run_child(args, variant, WARMUP, ["--profile"], XLA_FLAGS=flags.strip())
            records[variant]["profile"] = traced["profile"]
            records[variant]["profile_kinds"] = traced["profile_kinds"]
        # written after each variant, so that a run cut short keeps the variants it finished
        text = write_results(args, cfg, records)
    print(text)


def write_results(args, cfg: Config, records: dict) -> str:
    """``train_<config>.json``, ``.md`` and ``.png`` in ``args.out`` for the variants in
    ``records``; returns the summary's text."""
    first = next(iter(records.values()))
    where = (
        "quack_jax kernels" if first["kernels"] else "no sm_90 GPU: quack_jax ran its XLA fallback"
    )
    text = (
        f"config {args.config} {cfg}, {args.steps} steps, {first['device']} ({where}), "
        f"mesh {first['mesh']}, "
        f"jax {first['jax']}\n\n{summary(records)}"
    )
    name = f"train_{args.config}" + (f"_x{args.devices}" if args.devices > 1 else "")
    name += f"_vp{args.vocab_parallel}" if args.vocab_parallel > 1 else ""
    name += "_checkpointed" if args.checkpoint_blocks else ""
    meta = dict(config=args.config, params=dataclasses.asdict(cfg), steps=args.steps)
    (args.out / f"{name}.json").write_text(json.dumps(meta | dict(runs=records), indent=1))
    (args.out / f"{name}.md").write_text(text + "\n")
    plot(records, args.config, args.out / f"{name}.png")
    return text


if __name__ == "__main__":
    main()
