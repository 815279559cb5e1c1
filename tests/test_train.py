"""The training benchmark (benchmarks/train_lm.py) end to end with its tiny config on the
CPU: the variants train from the same seed on the same batches and agree; and its
``--max-batch`` search, judged against a given memory limit."""

import json
import pathlib
import re
import subprocess

import numpy as np
import pytest
from checks import assert_close

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("matplotlib")


@pytest.fixture
def train_lm(monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "benchmarks"))
    import train_lm

    return train_lm


def test_tiny_training_run(tmp_path, train_lm):
    steps = 12
    train_lm.main(["--config", "tiny", "--steps", str(steps), "--out", str(tmp_path), "--profile"])
    result = json.loads((tmp_path / "train_tiny.json").read_text())
    assert list(result["runs"]) == ["stock", "quack", "quack_jax_fused", "quack_jax_residual"]
    stock, quack, fused, residual = result["runs"].values()
    for run in (stock, quack, fused, residual):
        assert len(run["loss"]) == len(run["seconds"]) == steps
        assert np.isfinite(run["loss"]).all() and run["loss"][-1] < run["loss"][0] - 0.5
        assert run["tokens_per_s"] > 0 and not run["kernels"]
        assert {"norm", "softmax"} <= run["profile"].keys()
        assert "max_batch" not in run
    for run in (stock, quack):
        assert {"cross_entropy", "lm_head"} <= run["profile"].keys()
    # the fused head and loss: one op, one part, no logits
    for run in (fused, residual):
        assert "lm_head_cross_entropy" in run["profile"]
        assert not {"cross_entropy", "lm_head"} & run["profile"].keys()
    # bfloat16 activations: the variants' losses agree to bfloat16's tolerance
    pairs = [(v, "stock") for v in ("quack", "quack_jax_fused", "quack_jax_residual")]
    for a, b in [*pairs, ("quack_jax_fused", "quack"), ("quack_jax_residual", "quack_jax_fused")]:
        ref = np.array(result["runs"][b]["loss"])
        assert_close(result["runs"][a]["loss"], ref, np.abs(ref), "bfloat16", f"{a} vs {b} loss")
    report = (tmp_path / "train_tiny.md").read_text()
    assert "XLA fallback" in report and "| quack_jax_residual |" in report
    # each variant's step time beside stock's, and which of the two is faster, by how much
    for name in ("quack_jax", "quack_jax_fused", "quack_jax_residual"):
        said = rf"^{name} [\d.]+ ms/step, stock [\d.]+ ms/step: {name} [\d.]+x (faster|slower)$"
        assert re.search(said, report, re.MULTILINE), report
    assert "max batch" not in report
    assert (tmp_path / "train_tiny.png").stat().st_size > 10_000
    assert train_lm.CONFIGS["h200"].vocab >= 128 * 1024


def test_a_run_cut_short_keeps_the_variants_it_finished(tmp_path, train_lm, monkeypatch):
    """The results are written after each variant: a later variant that fails (a timeout,
    running out of memory) leaves the earlier ones' JSON and summary."""
    done = train_lm.run_child

    def child(args, variant, *rest, **env):
        if variant == "quack_jax_fused":
            raise subprocess.CalledProcessError(1, variant)
        return done(args, variant, *rest, **env)

    monkeypatch.setattr(train_lm, "run_child", child)
    with pytest.raises(subprocess.CalledProcessError):
        train_lm.main(["--config", "tiny", "--steps", "3", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "train_tiny.json").read_text())
    assert list(result["runs"]) == ["stock", "quack"]
    assert "| quack |" in (tmp_path / "train_tiny.md").read_text()


def test_llama_training_run(tmp_path, train_lm):
    """The Llama code at a CPU's size (grouped-query attention, RoPE, SwiGLU, the head tied
    to the embedding): the variants agree; the profile splits the step by model part and
    by kernel kind; the 1B configs have Llama 3.2-1B's shapes."""
    steps = 8
    args = ["--config", "llama-tiny", "--steps", str(steps), "--out", str(tmp_path), "--profile"]
    train_lm.main(args)
    result = json.loads((tmp_path / "train_llama-tiny.json").read_text())
    runs = result["runs"]
    for run in runs.values():
        assert np.isfinite(run["loss"]).all() and run["loss"][-1] < run["loss"][0]
        assert {"attention", "mlp", "norm"} <= run["profile"].keys()
        assert {"fusion: attention", "fusion: mlp"} <= run["profile_kinds"].keys()
    assert "lm_head_cross_entropy" in runs["quack_jax_residual"]["profile"]
    ref = np.array(runs["stock"]["loss"])
    for variant in ("quack", "quack_jax_fused", "quack_jax_residual"):
        assert_close(runs[variant]["loss"], ref, np.abs(ref), "bfloat16", f"{variant} loss")
    assert "by kernel kind" in (tmp_path / "train_llama-tiny.md").read_text()
    big = train_lm.CONFIGS["llama3-1b"]
    assert (big.d, big.layers, big.heads, big.kv_heads, big.ffn, big.vocab, big.tied) == (
        2048,
        16,
        32,
        8,
        8192,
        128256,
        True,
    )
    assert not train_lm.CONFIGS["llama3-1b-untied"].tied


def test_rope_keeps_norms_and_relative_angles(train_lm):
    """RoPE rotates each pair of a head's features: norms are kept, and the dot product of
    a rotated query and key depends only on their distance."""
    rotary = train_lm.rope(16, 32)
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 1, 1, 16)).astype(np.float32) for _ in range(2))
    at = [np.repeat(x, 32, axis=1) for x in (q, k)]
    rq, rk = (np.asarray(rotary(x)) for x in at)
    norms = [np.linalg.norm(x, axis=-1) for x in (rq, at[0])]
    assert_close(norms[0], norms[1], 1.0, "float32", "norm")
    dots = [float(rq[0, i, 0] @ rk[0, i + 3, 0]) for i in range(20)]
    assert_close(np.array(dots), np.full(20, dots[0]), 1.0 + abs(dots[0]), "float32", "angles")


@pytest.mark.parametrize(
    "memory",
    [
        lambda b: 1000 + 100 * b,  # linear: a few tries
        lambda b: 1000 + b * b,  # growing faster
        lambda b: 1000 + 400 * int(b**0.5),  # slower, in steps
        lambda b: None if b > 50 else 1000 + 100 * b,  # cannot be built past 50
    ],
)
def test_largest_search(train_lm, memory):
    """The largest multiple of the unit whose memory is within the limit, whatever the
    curve, trying only multiples of the unit; at most the cap, which it says."""
    for limit, start, unit in [(4700, 8, 1), (4700, 8, 2), (1500, 8, 1), (1900, 8, 4)]:
        tried = []

        def need(b, tried=tried):
            tried.append(b)
            return memory(b)

        def fits(b, limit=limit):
            return memory(b) is not None and memory(b) <= limit

        want = max((b for b in range(unit, 1 << 10, unit) if fits(b)), default=0)
        assert train_lm.largest(need, limit, start, unit, 1 << 10) == (want, False)
        assert all(b % unit == 0 for b in tried) and len(tried) == len(set(tried))
    found, capped = train_lm.largest(lambda b: 1000 + b, 10**9, 8, 1, 100)
    assert (found, capped) == (100, True)


def test_largest_search_is_short_on_a_line(train_lm):
    """Linear memory: the first two sizes give the answer, which two more tries confirm."""
    tried = []

    def need(b):
        tried.append(b)
        return 5000 + 1234 * b

    assert train_lm.largest(need, 200_000, 8, 1, 1 << 16) == (158, False)
    assert len(tried) <= 4, tried


def test_max_batch(train_lm, capsys):
    import jax

    cfg = train_lm.CONFIGS["tiny"]
    # the CPU reports no memory: it says it cannot judge
    found = train_lm.max_batch(cfg, "quack_jax_fused", 1, 0)
    assert found["batch"] is None and "cannot judge" in found["reason"]
    assert "cannot judge" in capsys.readouterr().err
    # against a given limit: the step at the batch found fits, one more sequence does not
    params, opt_state, step, by_rows = train_lm.setup(cfg, "quack_jax_fused", 1, 1, 0, 1, True)

    def need(batch):
        tokens = jax.ShapeDtypeStruct((batch, cfg.seq), "int32", sharding=by_rows)
        return train_lm.step_bytes(step.lower(params, opt_state, tokens, tokens).compile())

    at_start = need(cfg.batch)
    assert at_start["alias"] > 0  # the donated parameters and optimiser state
    limit = int(2.5 * at_start["total"])
    found = train_lm.max_batch(cfg, "quack_jax_fused", 1, 0, limit=limit)
    batch = found["batch"]
    assert 2 * cfg.batch <= batch < 4 * cfg.batch and not found["capped"]
    assert found["bytes"] == need(batch) and found["bytes"]["total"] <= limit
    assert need(batch + 1)["total"] > limit
    # with XLA kept from rematerializing: the CPU does not, so the same batch
    kept = train_lm.max_batch(cfg, "quack_jax_fused", 1, 0, limit=limit, remat=False)
    assert kept["batch"] == batch and found["remat"] and not kept["remat"]
    # the summary's column
    run = dict(step_seconds=1.0, tokens_per_s=1.0, peak_bytes=None, loss=[1.0], profile=None)
    assert "max batch" not in train_lm.summary({"quack_jax_fused": run})
    text = train_lm.summary({"quack_jax_fused": run | {"max_batch": found}})
    assert "max batch (sequences) |" in text and f"| {batch} (" in text


def test_checkpointed_blocks(tmp_path, train_lm):
    """``--checkpoint-blocks``: the same losses, files of their own, and each block made
    again in the backward (``jax.checkpoint`` lowers its recomputation behind an
    optimization barrier, one per block)."""
    import dataclasses

    import jax

    args = ["--config", "llama-tiny", "--steps", "3", "--variants", "stock", "quack_jax_residual"]
    train_lm.main([*args, "--out", str(tmp_path / "plain")])
    train_lm.main([*args, "--out", str(tmp_path / "ck"), "--checkpoint-blocks"])
    plain = json.loads((tmp_path / "plain" / "train_llama-tiny.json").read_text())
    ck = json.loads((tmp_path / "ck" / "train_llama-tiny_checkpointed.json").read_text())
    assert ck["params"]["checkpoint_blocks"] and not plain["params"]["checkpoint_blocks"]
    for variant, run in ck["runs"].items():
        ref = np.array(plain["runs"][variant]["loss"])
        assert_close(run["loss"], ref, np.abs(ref), "bfloat16", f"{variant} checkpointed loss")
    for checkpoint in (False, True):
        cfg = dataclasses.replace(train_lm.CONFIGS["llama-tiny"], checkpoint_blocks=checkpoint)
        params, opt_state, step, by_rows = train_lm.setup(cfg, "stock", 1, 1, 0, 1, True)
        tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), "int32", sharding=by_rows)
        text = step.lower(params, opt_state, tokens, tokens).as_text()
        assert text.count("optimization_barrier") == (cfg.layers if checkpoint else 0)
