"""Test set-up: 8 host devices for the sharding tests; the ``gpu`` marker; a private
kernel cache; one summary line of why tests were skipped.

Tests without the ``gpu`` marker run on the CPU device, so they exercise the XLA
fallback wherever they run; ``gpu`` tests (a test's "gpu" backend, see ``checks.py``)
need a CUDA device with quack_jax kernels (compute capability 9.0) and are skipped
elsewhere.

The suite never writes into the user's kernel cache: unless ``QUACK_JAX_CACHE`` names a
folder (as on a GPU machine given prebuilt cubins), the kernels it compiles go to a
temporary folder that is removed when the test run ends.
"""

import collections
import importlib.util
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
if "QUACK_JAX_CACHE" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="quack_jax-test-cache-")
    os.environ["QUACK_JAX_CACHE"] = _CACHE
else:
    _CACHE = None

import jax
import pytest

from quack_jax._lowering import lowering_path
from quack_jax._primitive import kernel_arch


def kernel_devices():
    try:
        return [d for d in jax.devices("cuda") if kernel_arch(d)]
    except RuntimeError:
        return []


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu`` tests without a kernel GPU, ``cutlass`` tests (they compile kernels)
    without CuTe-DSL."""
    skips = []
    if not kernel_devices():
        skips.append(("gpu", "need an sm_90 GPU (H100/H200)"))
    if importlib.util.find_spec("cutlass") is None:
        skips.append(("cutlass", "compile kernels: need nvidia-cutlass-dsl"))
    for marker, reason in skips:
        for item in items:
            if marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter):
    """One line that says why tests were skipped, counted by reason."""
    reasons = collections.Counter(
        report.longrepr[2].removeprefix("Skipped: ")
        for report in terminalreporter.stats.get("skipped", [])
        if isinstance(report.longrepr, tuple)
    )
    if reasons:
        terminalreporter.write_line(
            "skipped: " + "; ".join(f"{n} {why}" for why, n in reasons.most_common())
        )


def pytest_unconfigure(config):
    if _CACHE is not None:
        shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _backend(request, monkeypatch):
    """``gpu`` tests run on the default (CUDA) device, and every kernel lowered meanwhile
    fills its outputs with NaN before it runs, so a test sees any element a kernel fails
    to write; the others run on the CPU device. Every lowering for CUDA launches the
    kernels wherever they apply, also at the small shapes where quack_jax picks XLA's
    path (``_primitive.REFERENCE_FASTER``): the tests are of the kernels."""
    with lowering_path("kernel"):
        if "gpu" in request.keywords:
            monkeypatch.setenv("QUACK_JAX_POISON_OUTPUTS", "1")
            yield
        else:
            with jax.default_device(jax.devices("cpu")[0]):
                yield
