"""``jax.export`` round trips: a function of every op family (forward and gradient) is
exported with its kernels, serialised, and run in a fresh process where CuTe-DSL cannot
be imported, with the same results as in this process. On the CPU the artifact holds
both platforms (the launches are lowered for sm_90a from $QUACK_JAX_CUDA_ARCH, the CPU
part runs); on an H200 (``gpu``) it runs the kernels."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close, gpu_lengths

import quack_jax
from quack_jax import _ffi

pytest.importorskip("flatbuffers")  # jax.export's serialisation

# the fresh process: CuTe-DSL is made unimportable before quack_jax is imported
RUN = textwrap.dedent(
    """
    import sys

    class NoCutlass:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("cutlass", "cuda"):
                raise ImportError(f"{name} is not installed here")

    sys.meta_path.insert(0, NoCutlass())
    import jax
    import numpy as np
    import quack_jax

    inputs = np.load(sys.argv[2])
    exported = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
    device = jax.devices(sys.argv[4])[0]
    x = inputs["x"].astype(jax.numpy.bfloat16)  # saved as float32: exact
    args = [jax.device_put(a, device) for a in (x, inputs["w"], inputs["labels"])]
    np.savez(sys.argv[3], *[np.asarray(o, np.float32) for o in exported.call(*args)])
    assert not [m for m in sys.modules if m.split(".")[0] == "cutlass"]
    """
)


def model(x, w, labels):
    h = quack_jax.rms_norm(x, w, residual=x)
    loss, grads = jax.value_and_grad(
        lambda x, w: quack_jax.cross_entropy(quack_jax.layer_norm(x, w), labels)
    )(h, w)
    return loss, grads[0], grads[1], quack_jax.softmax(x), quack_jax.log_softmax(x)


def inputs():
    x = jax.random.normal(jax.random.key(0), (48, 1000), jnp.bfloat16)
    return x, jnp.linspace(0.5, 1.5, 1000), jnp.arange(48).at[3].set(-100)


def test_gpu_lengths_are_built():
    """The model's row length is one that every family's SPEC builds for the gpu tests:
    prebuild builds no others."""
    n = inputs()[0].shape[-1]
    for op in ("rms_norm", "layer_norm", "cross_entropy", "softmax", "log_softmax"):
        assert n in gpu_lengths(op), op


def round_trip(tmp_path, platforms, platform):
    x, w, labels = inputs()
    device = jax.devices(platform)[0]
    x, w, labels = jax.device_put((x, w, labels), device)
    exported = quack_jax.export.export(jax.jit(model), platforms=platforms)(x, w, labels)
    assert exported.mlir_module().count(f"@{_ffi.TARGET}") >= 4
    (tmp_path / "model.bin").write_bytes(exported.serialize())
    np.savez(tmp_path / "in.npz", x=np.asarray(x, np.float32), w=w, labels=labels)
    files = [str(tmp_path / f) for f in ("model.bin", "in.npz", "out.npz")]
    env = os.environ | {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # this process holds a GPU
    subprocess.run([sys.executable, "-c", RUN, *files, platform], check=True, timeout=300, env=env)
    got = np.load(tmp_path / "out.npz")
    want = [np.asarray(o, np.float32) for o in jax.jit(model)(x, w, labels)]
    assert_close(got["arr_0"], want[0], np.abs(want[0]), "float32", "loss")  # XLA's mean: any order
    for i, w in enumerate(want[1:], 1):  # the kernels' outputs: the same bits
        np.testing.assert_array_equal(got[f"arr_{i}"], w)


@pytest.mark.cutlass
def test_export_round_trip_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("QUACK_JAX_CUDA_ARCH", "sm_90a")
    round_trip(tmp_path, ("cuda", "cpu"), "cpu")


@pytest.mark.gpu
def test_export_round_trip_gpu(tmp_path):
    round_trip(tmp_path, ("cuda",), "cuda")


@pytest.mark.cutlass
def test_export_without_the_allowance_is_refused(monkeypatch):
    """Plain ``jax.export`` refuses the custom call: the wrapper is what allows it."""
    monkeypatch.setenv("QUACK_JAX_CUDA_ARCH", "sm_90a")
    x = jnp.ones((4, 128), jnp.float32)
    with pytest.raises(ValueError, match="custom call"):
        jax.export.export(jax.jit(quack_jax.softmax), platforms=("cuda",))(x)
