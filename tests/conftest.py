"""Test set-up: 8 host devices for the sharding tests; the ``gpu`` marker.

Tests without the ``gpu`` marker run on the CPU device, so they exercise the XLA
fallback wherever they run; ``gpu`` tests need a CUDA device with quack_jax kernels
(compute capability 9.0) and are skipped elsewhere.
"""

import importlib.util
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax
import pytest

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
        skips.append(("gpu", "needs a CUDA GPU with compute capability 9.0"))
    if importlib.util.find_spec("cutlass") is None:
        skips.append(("cutlass", "compiles kernels: needs nvidia-cutlass-dsl"))
    for marker, reason in skips:
        for item in items:
            if marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _cpu_unless_gpu(request):
    if "gpu" in request.keywords:
        yield
    else:
        with jax.default_device(jax.devices("cpu")[0]):
            yield


@pytest.fixture(scope="module")
def poison_outputs():
    """Kernels lowered meanwhile fill their outputs with NaN before they run, so a test
    sees any element a kernel fails to write."""
    os.environ["QUACK_JAX_POISON_OUTPUTS"] = "1"
    yield
    del os.environ["QUACK_JAX_POISON_OUTPUTS"]
