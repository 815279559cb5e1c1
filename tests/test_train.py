"""The training benchmark (benchmarks/train_lm.py) end to end with its tiny config on the
CPU: both variants train from the same seed on the same batches and agree."""

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("matplotlib")


def test_tiny_training_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "benchmarks"))
    import train_lm

    steps = 12
    train_lm.main(["--config", "tiny", "--steps", str(steps), "--out", str(tmp_path), "--profile"])
    result = json.loads((tmp_path / "train_tiny.json").read_text())
    stock, quack = result["runs"]["stock"], result["runs"]["quack"]
    for run in (stock, quack):
        assert len(run["loss"]) == len(run["seconds"]) == steps
        assert np.isfinite(run["loss"]).all() and run["loss"][-1] < run["loss"][0] - 0.5
        assert run["tokens_per_s"] > 0 and not run["kernels"]
        assert {"cross_entropy", "norm", "softmax"} <= run["profile"].keys()
    np.testing.assert_allclose(quack["loss"], stock["loss"], rtol=2e-3)
    report = (tmp_path / "train_tiny.md").read_text()
    assert "XLA fallback" in report and "quack_jax over stock" in report
    assert (tmp_path / "train_tiny.png").stat().st_size > 10_000
    assert train_lm.CONFIGS["h200"].vocab >= 128 * 1024
