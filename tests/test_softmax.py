"""softmax and log_softmax on both backends against float64 references: values and
gradients over the SPEC's grid, the axis argument (rank 1 to 3, tuples, None), where
(masked elements and rows), special values, forward
mode, the Hessian, rows of length 0; on the GPU also every device, CUDA graphs and CUDA
errors. What every op has (jit, vmap, checkpoint, scan, float64, no rows and one row,
bad arguments) is tested in ``test_contract.py``.

Each test checks both ops in one compiled function (compiles dominate the CPU run). The
GPU tests launch only the kernels that ``benchmarks/prebuild.py`` builds from the SPEC's
lowerings: forward, vjp and log_softmax's jvp at the gpu grid's sizes and dtypes.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close, backends, grid, key_for, run

import quack_jax
from quack_jax import _ffi
from quack_jax._cache import get_kernel
from quack_jax._primitive import kernel_arch
from quack_jax._tiling import choose_tiling
from quack_jax.softmax.config import Softmax
from quack_jax.softmax.tilings import SOFTMAX_FWD

OPS = {"softmax": quack_jax.softmax, "log_softmax": quack_jax.log_softmax}
# (shape, axis): rank 1 to 3, the axis last, in the middle (from either end) or first
AXES = [((1,), -1), ((7,), 0), ((2, 3, 5000), -1), ((3, 4096, 5), 1), ((4, 100, 3), -2)]
AXES += [((7, 4, 3), 0)]


def random(backend, shape, dtype, *parts, scale=1.0):
    """Normal draws times ``scale``, fresh each run (``key_for(*parts)``): numpy on the
    CPU (jax.random compiles for every shape), jax.random on the GPU (fast for big ones)."""
    key = key_for(*parts)
    if backend == "gpu":
        return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    return jnp.asarray((scale * rng.standard_normal(shape, np.float32)).astype(dtype))


def on_host(a):
    return not isinstance(a, jax.Array) or {d.platform for d in a.devices()} == {"cpu"}


def float64(fn):
    """A reference: ``fn(xp, *arrays)`` in float64, with numpy as ``xp`` for arrays on the
    host (nothing to compile) and jax.numpy, jitted, for device ones (big arrays). It gives
    for each op a tuple of results and the magnitudes their errors are judged against."""
    jitted = jax.jit(lambda *args: fn(jnp, *(a.astype(jnp.float64) for a in args)))

    def reference(*args):
        if all(map(on_host, args)):
            with np.errstate(invalid="ignore"):  # inf - inf is NaN, as in jax
                return fn(np, *(np.asarray(a, np.float64) for a in args))
        with jax.enable_x64(True):
            return jitted(*args)

    return reference


def softmax_rows(xp, x):
    """softmax and log_softmax over the last axis: NaN in rows with NaN or +inf or only
    -inf, as in jax.nn."""
    shifted = x - xp.max(x, axis=-1, keepdims=True)
    e = xp.exp(shifted)
    total = xp.sum(e, axis=-1, keepdims=True)
    return e / total, shifted - xp.log(total)


def magnitude(xp, y):
    """The size of y's terms: its own plus its row's largest (its shift by max and lse)."""
    size = xp.where(xp.isfinite(y), xp.abs(y), 0.0)
    return size + xp.max(size, axis=-1, keepdims=True, initial=0.0)


def row_sums(xp, *arrays):
    return [xp.sum(a, axis=-1, keepdims=True) for a in arrays]


@float64
def reference_vjp(xp, x, dy):
    """Each op's value and its gradient along dy, over the last axis."""
    p, y_log = softmax_rows(xp, x)
    dot, dot_abs = row_sums(xp, dy * p, xp.abs(dy) * p)
    total, total_abs = row_sums(xp, dy, xp.abs(dy))
    return {
        "softmax": (p, magnitude(xp, p), p * (dy - dot), p * (xp.abs(dy) + dot_abs)),
        "log_softmax": (
            y_log,
            magnitude(xp, y_log),
            dy - p * total,
            xp.abs(dy) + p * total_abs,
        ),
    }


@float64
def reference_jvp(xp, x, t):
    """Each op's value and its derivative along the tangent t, over the last axis."""
    p, y_log = softmax_rows(xp, x)
    dot, dot_abs = row_sums(xp, t * p, xp.abs(t) * p)
    return {
        "softmax": (p, magnitude(xp, p), p * (t - dot), p * (xp.abs(t) + dot_abs)),
        "log_softmax": (y_log, magnitude(xp, y_log), t - dot, xp.abs(t) + dot_abs),
    }


def _hessian_terms(p, w):
    """Bounds of the terms that make each op's Hessian of sum(w * sin(op(x))), with p the
    softmax of x and |sin|, |cos| <= 1: the sums over k of |w_k| times those of softmax's
    p_k (d_ki - p_i) (d_kj - p_j) and p_k p_i (d_ij - p_j), with p_k for the sine's, and of
    log-softmax's p_i (d_ij - p_j) and (d_ki - p_i) (d_kj - p_j), each difference taken as
    the sum of its terms (near a one-hot p, 1 - p cancels)."""
    d = jnp.eye(p.size)
    pk, a = p[:, None, None], jnp.abs(w)[:, None, None]
    both = (d[:, :, None] + p[None, :, None]) * (d[:, None, :] + p[None, None, :])  # k, i, j
    pij = p[:, None] * (d + p[None, :])
    softmax = jnp.sum(a * (pk * both + pk * pij + pk * pk * both), axis=0)
    log_softmax = jnp.sum(a * (pij + both), axis=0)
    return {"softmax": softmax, "log_softmax": log_softmax}


@jax.jit
def _hessians(x, w):
    out = {}
    terms = _hessian_terms(jax.nn.softmax(x), w)
    for name, f in (("softmax", jax.nn.softmax), ("log_softmax", jax.nn.log_softmax)):
        h = jax.jacfwd(jax.grad(lambda x, f=f: jnp.sum(jnp.sin(f(x)) * w)))(x)
        out[name] = (h, terms[name])
    return out


def reference_hessian(x, w):
    """Each op's Hessian of sum(w * sin(op(x))) for a vector x, in float64."""
    with jax.enable_x64(True):
        return _hessians(np.asarray(x, np.float64), np.asarray(w, np.float64))


def forward_backward(axis=-1):
    """Each op's value and its gradient along dy (``jax.vjp``), over ``axis``."""

    def f(x, dy):
        out = {}
        for name, fn in OPS.items():
            y, vjp = jax.vjp(lambda x, fn=fn: fn(x, axis), x)
            out[name] = (y, vjp(dy)[0])
        return out

    return f


def check(out, ref, dtype, what, **inputs):
    """Each op's value and derivative against the reference's."""
    for name, (y, d) in out.items():
        y_ref, y_mag, d_ref, d_mag = ref[name]
        assert y.dtype == d.dtype == dtype and y.shape == d.shape == y_ref.shape
        assert_close(y, y_ref, y_mag, dtype, f"{name} {what}", **inputs)
        assert_close(d, d_ref, d_mag, dtype, f"{name} derivative {what}", **inputs)


@pytest.mark.parametrize(("backend", "m", "n", "dtype"), grid("softmax"))
def test_values_and_gradients(backend, m, n, dtype):
    x = random(backend, (m, n), dtype, m, n, dtype, scale=3.0)
    dy = random(backend, (m, n), dtype, m, n, dtype, "dy")
    out = run(backend, forward_backward(), x, dy, launches=4)
    check(out, reference_vjp(x, dy), dtype, f"{m}x{n}", x=x, dy=dy)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("shape", "axis"), AXES)
@pytest.mark.parametrize("backend", backends())
def test_axis(backend, shape, axis, dtype):
    """Rank 1 to 3, the softmax axis last or moved there and back (the grid above covers
    float16)."""
    x = random(backend, shape, dtype, shape, axis, dtype, scale=3.0)
    dy = random(backend, shape, dtype, shape, axis, dtype, "dy")
    out = run(backend, forward_backward(axis), x, dy, launches=4)
    rows = reference_vjp(*(np.moveaxis(a, axis, -1) for a in (x, dy)))
    ref = {name: [np.moveaxis(a, -1, axis) for a in r] for name, r in rows.items()}
    check(out, ref, dtype, f"{shape} axis={axis}")


# (shape, axis, kernel launches): all axes, trailing ones (rows of 100, a gpu grid
# size), and axes that are not trailing (XLA's formulation)
AXIS_TUPLES = [((4, 5, 5), None, 4), ((2, 10, 10), (-2, -1), 4), ((10, 10), (0, 1), 4)]
AXIS_TUPLES += [((3, 4, 5), (0, 2), 0), ((5, 3, 4), (2, 0), 0)]


def to_rows(a, axes):
    """``a`` with ``axes`` moved last and flattened into one (numpy), and its inverse."""
    axes = tuple(range(a.ndim)) if axes is None else tuple(ax % a.ndim for ax in axes)
    last = tuple(range(a.ndim - len(axes), a.ndim))
    moved = np.moveaxis(np.asarray(a), axes, last)

    def back(r):
        return np.moveaxis(np.asarray(r).reshape(moved.shape), last, axes)

    return moved.reshape(*moved.shape[: last[0]], -1), back


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("shape", "axis", "launches"), AXIS_TUPLES)
@pytest.mark.parametrize("backend", backends())
def test_axis_tuples(backend, shape, axis, launches, dtype):
    """axis=None and tuples: trailing axes on the kernel, others on XLA."""
    x = random(backend, shape, dtype, shape, axis, dtype, scale=3.0)
    dy = random(backend, shape, dtype, shape, axis, dtype, "dy")
    out = run(backend, forward_backward(axis), x, dy, launches=launches)
    (x_rows, back), (dy_rows, _) = to_rows(x, axis), to_rows(dy, axis)
    ref = {name: [back(a) for a in r] for name, r in reference_vjp(x_rows, dy_rows).items()}
    check(out, ref, dtype, f"{shape} axis={axis}")


def masked(mask, ref):
    """Each op's (value, magnitude, derivative, magnitude) from ``reference_vjp`` (or
    ``reference_jvp``) of x with -inf where ``mask`` is False and the cotangent (or
    tangent) zeroed there: masked elements, and whole masked rows, give 0 (log_softmax's
    value -inf) and zero derivatives, as jax.nn."""
    out = {}
    for name, (y, y_mag, d, d_mag) in ref.items():
        fill = -np.inf if name == "log_softmax" else 0.0
        zeros = (np.where(mask, a, 0.0) for a in (y_mag, d, d_mag))
        out[name] = [np.where(mask, y, fill), *zeros]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", backends())
def test_where(backend, dtype):
    """A mask with fully masked rows, and one broadcast from a column: values, gradients
    and jvp against float64; the kernels run on the masked x."""
    shape = (6, 100)
    x = random(backend, shape, dtype, "where", dtype, scale=3.0)
    dy = random(backend, shape, dtype, "where", dtype, "dy")
    mask = np.asarray(random("cpu", shape, "float32", "where", "mask")) > -0.5
    mask[2] = mask[5] = False
    rows = np.array([True, False, True, True, False, True])[:, None]

    def f(x, dy, mask, rows):
        out = {}
        for name, fn in OPS.items():
            for key, w in (("mask", mask), ("rows", rows)):
                y, vjp = jax.vjp(lambda x, fn=fn, w=w: fn(x, -1, w), x)
                out[name, key] = (
                    y,
                    vjp(dy)[0],
                    jax.jvp(lambda x, fn=fn, w=w: fn(x, where=w), (x,), (dy,))[1],
                )
        return out

    # per op and mask, vjp: forward and backward; jvp: softmax's forward and derivative
    # (it reads y), log_softmax's derivative alone (it reads x)
    out = run(backend, f, x, dy, jnp.asarray(mask), jnp.asarray(rows), launches=14)
    for key, w in (("mask", mask), ("rows", np.broadcast_to(rows, shape))):
        x_in = np.where(w, np.asarray(x, np.float32), -np.inf).astype(dtype)
        dy_in = np.where(w, np.asarray(dy, np.float32), 0).astype(dtype)
        vjp_ref, jvp_ref = (
            masked(w, reference_vjp(x_in, dy_in)),
            masked(w, reference_jvp(x_in, dy_in)),
        )
        for name in OPS:
            y, dx, ty = out[name, key]
            what = f"{name} where={key}"
            assert y.dtype == dx.dtype == ty.dtype == dtype
            y_ref, y_mag, d_ref, d_mag = vjp_ref[name]
            assert_close(y, y_ref, y_mag, dtype, what)
            assert_close(dx, d_ref, d_mag, dtype, f"{what} grad")
            assert_close(ty, *jvp_ref[name][2:], dtype, f"{what} jvp")


@pytest.mark.parametrize(("backend", "n", "dtype"), grid("softmax", special=True))
def test_special_values(backend, n, dtype):
    """NaN, +-inf and large values propagate as in jax.nn (float64)."""
    big = 6e4 if dtype == "float16" else 1e4
    x = np.array(random(backend, (8, n), "float32", n, dtype, scale=3.0))
    x[0, n // 2] = np.nan
    x[1, n // 3] = np.inf
    x[2, :] = -np.inf
    x[3, ::2] = -np.inf
    x[4, :] = big
    x[5, n - 1] = big
    x[6, :] = -big
    x = jnp.asarray(x.astype(jnp.dtype(dtype)))
    dy = random(backend, x.shape, dtype, n, dtype, "dy")
    out = run(backend, forward_backward(), x, dy, launches=4)
    check(out, reference_vjp(x, dy), dtype, f"special values n={n}", x=x)


@pytest.mark.parametrize(
    ("backend", "n", "dtype"), grid("softmax", special=True, dtypes=("float32", "bfloat16"))
)
def test_jvp(backend, n, dtype):
    x = random(backend, (1000, n), dtype, "jvp", n, dtype, scale=3.0)
    t = random(backend, (1000, n), dtype, "jvp", n, dtype, "t")

    def f(x, t):
        return {name: jax.jvp(fn, (x,), (t,)) for name, fn in OPS.items()}

    out = run(backend, f, x, t, launches=4)
    check(out, reference_jvp(x, t), dtype, f"jvp n={n}", x=x, t=t)


@pytest.mark.parametrize("backend", backends())
def test_hessian(backend):
    """The Hessian, forward over reverse: the kernels and the derivative's XLA reference
    together."""
    x = random(backend, (7,), "float32", "hessian", scale=3.0)
    w = random(backend, (7,), "float32", "hessian", "w")

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x)) * w)

    def f(x, w):
        return {name: jax.jacfwd(jax.grad(loss(fn)))(x, w) for name, fn in OPS.items()}

    # per op, the forward and its jvp
    out = run(backend, f, x, w, launches=4)
    hessian = reference_hessian(x, w)
    for name, h in out.items():
        assert_close(h, *hessian[name], "float32", f"{name} hessian")


@pytest.mark.parametrize("shape", [(3, 0), (2, 3, 0)])
@pytest.mark.parametrize("backend", backends())
def test_rows_of_length_zero(backend, shape):
    """Rows of no elements (no rows at all: ``test_contract.py``)."""
    x = jnp.ones(shape, jnp.bfloat16)
    out = run(backend, forward_backward(), x, x, launches=0)
    for y, dx in out.values():
        assert y.shape == dx.shape == shape and y.dtype == dx.dtype == x.dtype


def test_import_does_not_load_cutlass():
    code = "import quack_jax, sys; assert 'cutlass' not in sys.modules, 'cutlass imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
def test_every_gpu():
    x = jax.random.normal(key_for("devices"), (1000, 65536), jnp.float32)
    for device in [d for d in jax.devices("cuda") if kernel_arch(d)]:
        xd = jax.device_put(x, device)
        y = jax.jit(quack_jax.softmax)(xd)
        assert y.devices() == {device}
        assert_close(y, *reference_vjp(x, x)["softmax"][:2], "float32", f"on {device}")


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


@pytest.mark.gpu
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
    result = subprocess.run(
        [sys.executable, "-c", COMMAND_BUFFER_SCRIPT], env=env, capture_output=True, text=True
    )
    print(result.stdout, result.stderr[-3000:])
    assert result.returncode == 0 and "OK" in result.stdout
    expected = "command_buffer=FUSION" in flags
    assert f"launches captured in CUDA graphs: {expected}" in result.stdout


@pytest.mark.gpu
def test_cuda_errors_are_python_exceptions():
    _ffi.register_target()
    x = jnp.ones((32, 1024), jnp.float32)
    call = jax.ffi.ffi_call(_ffi.TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))
    tiling = choose_tiling(SOFTMAX_FWD, 1024, 4)
    kernel = get_kernel(Softmax(), "float32", tiling, "sm_90a")

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
