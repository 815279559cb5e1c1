"""The softmax kernels on an sm_90 GPU, against float64 references.

Every launch here fills its outputs with NaN first (QUACK_JAX_POISON_OUTPUTS), so an
element a kernel fails to write shows up as a NaN where the reference has a number.
Inputs are fresh random draws each run; the seed is printed with any failure.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close, key_for, run_kernels
from shapes import GPU_DTYPES, GPU_ROWS, GPU_SIZES, MAX_ELEMENTS, SPECIAL_SIZES

import quack_jax
from quack_jax import _ffi
from quack_jax._cache import get_kernel
from quack_jax._primitive import kernel_arch
from quack_jax._tiling import choose_tiling

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


def reference_forward(x, log=False):
    """float64 softmax of x, and the magnitude its error is judged against."""
    with jax.enable_x64(True):
        x64 = jnp.asarray(x).astype(jnp.float64)
        ref = jax.nn.log_softmax(x64) if log else jax.nn.softmax(x64)
        size = jnp.where(jnp.isfinite(ref), jnp.abs(ref), 0.0)
        return ref, size + jnp.max(size, axis=-1, keepdims=True)


def reference_backward(dy, x, log=False):
    """float64 gradient from x and dy, and the magnitude of the terms that make it."""
    with jax.enable_x64(True):
        dy64 = jnp.asarray(dy).astype(jnp.float64)
        p = jax.nn.softmax(jnp.asarray(x).astype(jnp.float64))
        total, total_abs = (jnp.sum(a, axis=-1, keepdims=True) for a in (dy64, jnp.abs(dy64)))
        if log:
            return dy64 - p * total, jnp.abs(dy64) + p * total_abs
        dot = jnp.sum(dy64 * p, axis=-1, keepdims=True)
        dot_abs = jnp.sum(jnp.abs(dy64) * p, axis=-1, keepdims=True)
        return p * (dy64 - dot), p * (jnp.abs(dy64) + dot_abs)


def forward_backward(fn):
    def f(x, dy):
        y, vjp = jax.vjp(fn, x)
        return y, vjp(dy)[0]

    return f


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("n", GPU_SIZES)
@pytest.mark.parametrize("m", GPU_ROWS)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_forward_backward(m, n, dtype, log):
    if m * n > MAX_ELEMENTS:
        pytest.skip("beyond the float64 reference's memory budget")
    kx, kdy = jax.random.split(key_for(m, n, dtype, log))
    x = (3.0 * jax.random.normal(kx, (m, n), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kdy, (m, n), jnp.float32).astype(dtype)
    fn = quack_jax.log_softmax if log else quack_jax.softmax
    y, dx = run_kernels(forward_backward(fn), x, dy, launches=2)
    assert y.dtype == dx.dtype == x.dtype and y.shape == dx.shape == x.shape
    assert_close(y, *reference_forward(x, log), dtype, f"forward {m}x{n}", x=x)
    assert_close(dx, *reference_backward(dy, x, log), dtype, f"backward {m}x{n}", x=x, dy=dy)


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("n", SPECIAL_SIZES)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_special_values(n, dtype, log):
    big = 6e4 if dtype == "float16" else 1e4
    x = np.array(3.0 * jax.random.normal(key_for(n, dtype), (8, n), jnp.float32))
    x[0, n // 2] = np.nan
    x[1, n // 3] = np.inf
    x[2, :] = -np.inf
    x[3, ::2] = -np.inf
    x[4, :] = big
    x[5, n - 1] = big
    x[6, :] = -big
    x = jnp.asarray(x).astype(dtype)
    dy = jax.random.normal(key_for(n, dtype, "dy"), x.shape, jnp.float32).astype(dtype)
    fn = quack_jax.log_softmax if log else quack_jax.softmax
    y, dx = run_kernels(forward_backward(fn), x, dy, launches=2)
    assert_close(y, *reference_forward(x, log), dtype, f"special values n={n}", x=x)
    assert_close(dx, *reference_backward(dy, x, log), dtype, f"special values n={n}", x=x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", SPECIAL_SIZES)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_jvp(n, dtype, log):
    kx, kt = jax.random.split(key_for("jvp", n, dtype, log))
    x = (3.0 * jax.random.normal(kx, (1000, n), jnp.float32)).astype(dtype)
    t = jax.random.normal(kt, x.shape, jnp.float32).astype(dtype)
    fn = quack_jax.log_softmax if log else quack_jax.softmax
    y, y_dot = run_kernels(lambda x, t: jax.jvp(fn, (x,), (t,)), x, t, launches=2)
    assert_close(y, *reference_forward(x, log), dtype, f"jvp primal n={n}")
    with jax.enable_x64(True):
        t64 = t.astype(jnp.float64)
        p = jax.nn.softmax(x.astype(jnp.float64))
        dot, dot_abs = (jnp.sum(p * a, axis=-1, keepdims=True) for a in (t64, jnp.abs(t64)))
        ref, mag = (
            (t64 - dot, jnp.abs(t64) + dot_abs)
            if log
            else (p * (t64 - dot), p * (jnp.abs(t64) + dot_abs))
        )
    assert_close(y_dot, ref, mag, dtype, f"jvp tangent n={n}", x=x, t=t)


@pytest.mark.parametrize("shape", [(0, 1024), (4, 0), (2, 0, 7)])
def test_empty(shape):
    x = jnp.ones(shape, jnp.bfloat16)
    y, dx = run_kernels(forward_backward(quack_jax.softmax), x, x, launches=0)
    assert y.shape == dx.shape == shape


def test_rank3_and_inner_axis():
    x = jax.random.normal(key_for("rank3"), (3, 4096, 5), jnp.float32)
    y = run_kernels(lambda x: quack_jax.softmax(x, axis=1), x, launches=1)
    y_ref, mag = (jnp.moveaxis(a, -1, 1) for a in reference_forward(jnp.moveaxis(x, 1, -1)))
    assert_close(y, y_ref, mag, "float32", "axis=1")


def test_vmap_and_checkpoint():
    x = jax.random.normal(key_for("vmap"), (6, 7, 100), jnp.bfloat16)
    f = jax.vmap(jax.checkpoint(quack_jax.softmax), in_axes=1, out_axes=1)
    y = run_kernels(f, x, launches=1)
    assert_close(y, *reference_forward(x), "bfloat16", "vmap")
    w = jax.random.normal(key_for("vmap", "w"), x.shape, jnp.float32)
    g = jax.jit(jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32) * w)))(x)
    assert_close(g, *reference_backward(w, x), "bfloat16", "grad through vmap and checkpoint")


def test_every_gpu():
    x = jax.random.normal(key_for("devices"), (1000, 65536), jnp.float32)
    for device in [d for d in jax.devices("cuda") if kernel_arch(d)]:
        xd = jax.device_put(x, device)
        y = jax.jit(quack_jax.softmax)(xd)
        assert y.devices() == {device}
        assert_close(y, *reference_forward(x), "float32", f"on {device}")


COMMAND_BUFFER_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, quack_jax
    from quack_jax import _ffi
    def f(x, dy):
        y, vjp = jax.vjp(quack_jax.softmax, x)
        return y, vjp(dy)[0], quack_jax.log_softmax(x)
    x = jax.random.normal(jax.random.key(1), (1000, 65536), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), x.shape, jnp.float32).astype(jnp.bfloat16)
    compiled = jax.jit(f).lower(x, dy).compile()
    for _ in range(3):
        y, dx, ly = compiled(x, dy)
    jax.block_until_ready((y, dx, ly))
    print("launches captured in CUDA graphs:", _ffi.captured_launches() > 0)
    x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
    y_ref, vjp = jax.vjp(jax.nn.softmax, x32)
    for out, ref in ((y, y_ref), (dx, vjp(dy32)[0]), (ly, jax.nn.log_softmax(x32))):
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
        scale = float(jnp.max(jnp.abs(ref)))
        assert err <= 1e-2 * scale, (err, scale)
    print("OK")
    """
)


@pytest.mark.parametrize(
    "flags",
    [
        "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
        "--xla_gpu_enable_command_buffer=",
    ],
    ids=["command_buffers_on", "command_buffers_off"],
)
def test_command_buffers(flags):
    env = dict(os.environ, XLA_FLAGS=flags)
    run = subprocess.run(
        [sys.executable, "-c", COMMAND_BUFFER_SCRIPT], env=env, capture_output=True, text=True
    )
    print(run.stdout, run.stderr[-3000:])
    assert run.returncode == 0 and "OK" in run.stdout
    expected = "command_buffer=FUSION" in flags
    assert f"launches captured in CUDA graphs: {expected}" in run.stdout


def test_cuda_errors_are_python_exceptions():
    _ffi.register_target()
    x = jnp.ones((32, 1024), jnp.float32)
    call = jax.ffi.ffi_call(_ffi.TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))
    tiling = choose_tiling("softmax_fwd", 1024, 4)
    kernel = get_kernel("softmax_fwd", "float32", tiling, "sm_90a")

    def launch_attrs(**changes):
        attrs = dict(
            cubin=np.frombuffer(kernel.cubin, np.uint8),
            cubin_hash=kernel.digest,
            kernel=kernel.symbol,
            grid=np.array(tiling.grid(32)),
            block=np.array(tiling.block),
            cluster=np.array(tiling.cluster),
            smem=kernel.smem_bytes,
            scalars=np.array([32], np.int32),
            poison=0,
        )
        return attrs | changes

    garbage = launch_attrs(
        cubin=np.frombuffer(b"not a cubin at all", np.uint8), cubin_hash=1, kernel="broken_kernel"
    )
    with pytest.raises(Exception, match=r"broken_kernel.*cuModuleLoadData.*CUDA_ERROR"):
        jax.block_until_ready(jax.jit(lambda x: call(x, **garbage))(x))
    too_big = launch_attrs(block=np.array([4096, 1, 1]))
    with pytest.raises(Exception, match=r"cuLaunchKernelEx.*CUDA_ERROR_INVALID_VALUE"):
        jax.block_until_ready(jax.jit(lambda x: call(x, **too_big))(x))
    good = jax.jit(lambda x: call(x, **launch_attrs()))(x)
    np.testing.assert_allclose(np.asarray(good), 1.0 / 1024, rtol=1e-6)
