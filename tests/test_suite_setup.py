"""The test suite's own promises: it writes no kernel into the user's cache, and its
summary says why tests were skipped."""

import os
import pathlib
import subprocess
import sys

from quack_jax import _cache


def test_the_suite_never_uses_the_default_cache(monkeypatch):
    used = _cache.cache_dir()
    monkeypatch.delenv("QUACK_JAX_CACHE")
    assert used != _cache.cache_dir()


def test_the_summary_counts_skips_by_reason(tmp_path):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.skip(reason='need a thing')\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "def test_a(i):\n    pass\n\n"
        "@pytest.mark.skip(reason='need another')\n"
        "def test_b():\n    pass\n\n"
        "def test_c():\n    pass\n"
    )
    conftest = pathlib.Path(__file__).with_name("conftest.py")
    (tmp_path / "conftest.py").write_text(conftest.read_text())
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=os.environ | {"JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skipped: 3 need a thing; 1 need another" in run.stdout.splitlines()
