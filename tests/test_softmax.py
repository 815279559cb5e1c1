"""softmax / log_softmax through the XLA fallback (CPU): values, gradients, transforms,
special values and bad input. The GPU kernels are checked in test_gpu_softmax.py."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quack_jax

RNG = np.random.default_rng()
TOL = {"float32": 1e-6, "bfloat16": 1e-2, "float16": 2e-3, "float64": 1e-12}
OPS = {
    "softmax": (quack_jax.softmax, jax.nn.softmax),
    "log_softmax": (quack_jax.log_softmax, jax.nn.log_softmax),
}


def np_softmax(x, axis, log):
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    shifted = x - x.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    y = shifted - lse if log else np.exp(shifted - lse)
    return np.moveaxis(y, -1, axis)


def random(shape, dtype, scale=3.0):
    return jnp.asarray(scale * RNG.standard_normal(shape), jnp.float32).astype(dtype)


def assert_close(out, ref, dtype):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    scale = np.max(np.abs(ref), initial=0.0)
    np.testing.assert_allclose(out, ref, rtol=TOL[dtype], atol=TOL[dtype] * max(scale, 1e-30))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(
    ("shape", "axis"),
    [
        ((1,), -1),
        ((7,), 0),
        ((3, 1000), -1),
        ((2, 3, 5000), -1),
        ((4, 100, 3), 1),
        ((1, 131071), 1),
        ((5, 1), -1),
    ],
)
def test_forward_matches_float64(name, dtype, shape, axis):
    x = random(shape, dtype)
    out = jax.jit(OPS[name][0], static_argnums=1)(x, axis)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close(out, np_softmax(x, axis, name == "log_softmax"), dtype)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("shape", "axis"), [((3, 1000), -1), ((4, 37, 3), 1)])
def test_gradient_matches_float64(name, dtype, shape, axis):
    x, w = random(shape, dtype), random(shape, dtype, 1.0)
    fn = OPS[name][0]
    grad = jax.jit(jax.grad(lambda x: jnp.sum(fn(x, axis).astype(jnp.float32) * w)))(x)
    assert grad.dtype == x.dtype
    y = np_softmax(x, axis, False)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    if name == "log_softmax":
        ref = w64 - y * w64.sum(axis=axis, keepdims=True)
    else:
        ref = y * (w64 - (w64 * y).sum(axis=axis, keepdims=True))
    assert_close(grad, ref, dtype)


@pytest.mark.parametrize("name", OPS)
def test_matches_jax_nn_with_transforms(name):
    ours, theirs = OPS[name]
    x = random((6, 5, 300), "float32")

    def loss(fn):
        return lambda x: jnp.sum(jnp.sin(fn(x)))

    np.testing.assert_allclose(
        jax.vmap(ours, 1, 1)(x), jax.vmap(theirs, 1, 1)(x), rtol=2e-5, atol=4e-6
    )
    np.testing.assert_allclose(
        jax.jit(jax.grad(loss(jax.checkpoint(ours))))(x),
        jax.grad(loss(theirs))(x),
        rtol=2e-5,
        atol=4e-6,
    )
    np.testing.assert_allclose(
        jax.vmap(jax.grad(loss(ours)), in_axes=2)(x),
        jax.vmap(jax.grad(loss(theirs)), in_axes=2)(x),
        rtol=2e-5,
        atol=4e-6,
    )
    hessian = jax.jacfwd(jax.grad(loss(ours)))(x[0, 0, :16])
    np.testing.assert_allclose(hessian, jax.jacfwd(jax.grad(loss(theirs)))(x[0, 0, :16]), atol=1e-5)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_special_values_like_jax_nn(name, dtype):
    big = 6e4 if dtype == "float16" else 1e4
    x = np.array(3.0 * RNG.standard_normal((8, 40)), np.float32)
    x[0, 20] = np.nan
    x[1, 13] = np.inf
    x[2, :] = -np.inf
    x[3, ::2] = -np.inf
    x[4, :] = big
    x[5, -1] = big
    x[6, :] = -big
    x = jnp.asarray(x).astype(dtype)
    ours, theirs = OPS[name]
    out = np.asarray(ours(x).astype(jnp.float32))
    ref = np.asarray(theirs(x.astype(jnp.float32)))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_allclose(out, ref, rtol=TOL[dtype], atol=TOL[dtype] * 10)


@pytest.mark.parametrize("shape", [(0, 16), (3, 0), (2, 0, 5)])
def test_empty(shape):
    x = jnp.zeros(shape, jnp.bfloat16)
    assert quack_jax.softmax(x).shape == shape
    assert jax.grad(lambda x: jnp.sum(quack_jax.log_softmax(x)))(x).shape == shape


def test_float64_uses_reference():
    with jax.enable_x64(True):
        x = jnp.asarray(RNG.standard_normal((3, 50)))
        assert quack_jax.softmax(x).dtype == jnp.float64
        np.testing.assert_allclose(quack_jax.softmax(x), np_softmax(x, -1, False), rtol=1e-12)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (([1.0, 2.0],), TypeError, "x must be an array"),
        (("abc",), TypeError, "x must be an array"),
        ((np.arange(4),), TypeError, "x must have a floating dtype"),
        ((jnp.ones(4, jnp.int32),), TypeError, "x must have a floating dtype"),
        ((jnp.ones(4, jnp.complex64),), TypeError, "x must have a floating dtype"),
        ((jnp.ones(4, bool),), TypeError, "x must have a floating dtype"),
        ((jnp.float32(1.0),), ValueError, "x must have at least one dimension"),
        ((jnp.ones((2, 3)), 2), ValueError, "axis 2 is out of range"),
        ((jnp.ones((2, 3)), -3), ValueError, "axis -3 is out of range"),
        ((jnp.ones((2, 3)), 1.0), TypeError, "axis must be an int"),
        ((jnp.ones((2, 3)), (0, 1)), TypeError, "axis must be an int"),
    ],
)
@pytest.mark.parametrize("name", OPS)
def test_bad_input(name, args, error, message):
    fn = OPS[name][0]
    with pytest.raises(error, match=f"{name}: {message}"):
        fn(*args)
    if isinstance(args[0], jax.Array):  # the same error at trace time under jit
        with pytest.raises(error, match=f"{name}: {message}"):
            jax.jit(fn, static_argnums=tuple(range(1, len(args))))(*args)


def test_import_does_not_load_cutlass():
    code = "import quack_jax, sys; assert 'cutlass' not in sys.modules, 'cutlass imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
