"""quack_jax.flax against Flax's own norms: the same parameters, outputs, dtypes and grads."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quack_jax

pytest.importorskip("flax")
from flax import linen as nn
from flax import nnx

from quack_jax.flax import linen as qnn
from quack_jax.flax import nnx as qnnx

N = 64
KINDS = {"rms": ("RMSNorm", "rms_norm"), "layer": ("LayerNorm", "layer_norm")}
bf16, f32 = jnp.bfloat16, jnp.float32

# (kind, constructor arguments, x's dtype, whether quack_jax computes it)
CASES = [
    *[(k, {}, f32, True) for k in KINDS],
    *[(k, {}, bf16, True) for k in KINDS],
    *[(k, {"param_dtype": bf16}, f32, True) for k in KINDS],
    *[(k, {"param_dtype": bf16}, bf16, True) for k in KINDS],
    *[(k, {"param_dtype": jnp.float16}, bf16, True) for k in KINDS],
    *[(k, {"dtype": bf16}, f32, True) for k in KINDS],
    *[(k, {"dtype": f32, "param_dtype": bf16}, bf16, True) for k in KINDS],
    *[(k, {"epsilon": 1e-2}, f32, True) for k in KINDS],
    *[(k, {"use_scale": False}, bf16, True) for k in KINDS],
    *[(k, {"use_fast_variance": False}, f32, True) for k in KINDS],
    *[(k, {"reduction_axes": 2, "feature_axes": (-1,)}, f32, True) for k in KINDS],
    *[(k, {"scale_init": nn.initializers.normal(0.5)}, bf16, True) for k in KINDS],
    ("layer", {"use_bias": False}, f32, True),
    ("layer", {"use_scale": False, "use_bias": False}, f32, True),
    ("layer", {"bias_init": nn.initializers.normal(0.3), "param_dtype": bf16}, f32, True),
    *[(k, {"reduction_axes": (1, 2), "feature_axes": -1}, f32, False) for k in KINDS],
    *[(k, {"reduction_axes": (1, 2), "feature_axes": -1}, bf16, False) for k in KINDS],
    ("layer", {"reduction_axes": -1, "feature_axes": (1, 2)}, f32, False),
]
IDS = [
    "-".join([k, jnp.dtype(x).name, *(f"{a}={getattr(v, '__name__', v)}" for a, v in kw.items())])
    for k, kw, x, _ in CASES
]


def assert_close(a, b):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    tol = 1e-5 if a.dtype.itemsize >= 4 else 1e-2
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol, atol=tol)


def assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_array_equal(np.float32(u), np.float32(v))


def perturbed(tree, seed=7):
    """A trained-looking checkpoint: every parameter moved by a random amount."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [
        (p + 0.2 * jax.random.normal(k, p.shape)).astype(p.dtype)
        for p, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, moved)


def inputs(dtype, shape=(3, 5, N), seed=1):
    return (1.5 * jax.random.normal(jax.random.key(seed), shape) + 0.3).astype(dtype)


@pytest.fixture
def quack_calls(monkeypatch):
    """The quack_jax functions the modules call, in order."""
    calls = []

    def counted(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    for name in ("rms_norm", "layer_norm"):
        monkeypatch.setattr(quack_jax, name, counted(name, getattr(quack_jax, name)))
    return calls


# -- linen --------------------------------------------------------------------------


@pytest.mark.parametrize("kind, kwargs, x_dtype, fast", CASES, ids=IDS)
def test_linen_matches_flax(kind, kwargs, x_dtype, fast, quack_calls):
    cls, fn = KINDS[kind]
    ours, theirs = getattr(qnn, cls)(**kwargs), getattr(nn, cls)(**kwargs)
    x = inputs(x_dtype)
    params = ours.init(jax.random.key(0), x)
    flax_params = theirs.init(jax.random.key(0), x)
    assert_same_tree(params, flax_params)

    checkpoint = perturbed(flax_params)
    quack_calls.clear()
    for variables in (flax_params, checkpoint):
        assert_close(ours.apply(variables, x), theirs.apply(variables, x))
        assert_close(jax.jit(ours.apply)(variables, x), theirs.apply(variables, x))
    assert quack_calls == [fn] * 4 * fast


@pytest.mark.parametrize("kind", KINDS)
def test_linen_mask_and_axis_name_use_flax(kind, quack_calls):
    cls, _ = KINDS[kind]
    x = inputs(f32)
    variables = perturbed(getattr(nn, cls)().init(jax.random.key(0), x))
    mask = jnp.arange(N) < N // 2
    assert_close(
        getattr(qnn, cls)().apply(variables, x, mask=mask),
        getattr(nn, cls)().apply(variables, x, mask=mask),
    )

    def per_row(module):
        return jax.vmap(lambda r: module.apply(variables, r), axis_name="rows")(x)

    assert_close(
        per_row(getattr(qnn, cls)(axis_name="rows", reduction_axes=(0, 1))),
        per_row(getattr(nn, cls)(axis_name="rows", reduction_axes=(0, 1))),
    )
    assert quack_calls == []


class MLP(nn.Module):
    norm: type
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(N, dtype=self.dtype, param_dtype=self.dtype)(x)
        x = self.norm(dtype=self.dtype, param_dtype=self.dtype)(x)
        return nn.Dense(16, dtype=self.dtype, param_dtype=self.dtype)(x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_linen_grad_through_model(kind, dtype, quack_calls):
    cls, fn = KINDS[kind]
    ours, theirs = MLP(getattr(qnn, cls), dtype), MLP(getattr(nn, cls), dtype)
    x = inputs(dtype, (4, 6, 32))
    params = ours.init(jax.random.key(0), x)
    assert_same_tree(params, theirs.init(jax.random.key(0), x))
    params = perturbed(params)

    def loss(model):
        return lambda p, x: jnp.sum(jnp.square(model.apply(p, x).astype(f32)))

    quack_calls.clear()
    ours_grads = jax.grad(loss(ours), argnums=(0, 1))(params, x)
    assert quack_calls == [fn]
    theirs_grads = jax.grad(loss(theirs), argnums=(0, 1))(params, x)
    assert jax.tree.structure(ours_grads) == jax.tree.structure(theirs_grads)
    for a, b in zip(jax.tree.leaves(ours_grads), jax.tree.leaves(theirs_grads), strict=True):
        scale = float(jnp.max(jnp.abs(b.astype(f32))))
        tol = 1e-4 if dtype == f32 else 2e-2
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol, atol=tol * scale)


# -- nnx ----------------------------------------------------------------------------


def nnx_pair(cls, kwargs):
    n = 5 * N if kwargs.get("feature_axes") == (1, 2) else N
    return tuple(getattr(m, cls)(n, **kwargs, rngs=nnx.Rngs(0)) for m in (qnnx, nnx))


@pytest.mark.parametrize("kind, kwargs, x_dtype, fast", CASES, ids=IDS)
def test_nnx_matches_flax(kind, kwargs, x_dtype, fast, quack_calls):
    cls, fn = KINDS[kind]
    ours, theirs = nnx_pair(cls, kwargs)
    assert type(ours).__name__ == cls
    assert_same_tree(nnx.state(ours), nnx.state(theirs))
    assert nnx.graphdef(ours).attributes == nnx.graphdef(theirs).attributes

    x = inputs(x_dtype)
    quack_calls.clear()
    assert_close(ours(x), theirs(x))
    nnx.update(theirs, perturbed(nnx.state(theirs)))
    nnx.update(ours, nnx.state(theirs))
    assert_close(ours(x), theirs(x))
    assert_close(nnx.jit(lambda m, x: m(x))(ours, x), theirs(x))
    assert quack_calls == [fn] * 3 * fast


@pytest.mark.parametrize("kind", KINDS)
def test_nnx_mask_uses_flax(kind, quack_calls):
    cls, _ = KINDS[kind]
    ours, theirs = nnx_pair(cls, {})
    x, mask = inputs(f32), jnp.arange(N) < N // 2
    assert_close(ours(x, mask=mask), theirs(x, mask=mask))
    assert quack_calls == []


class NNXModel(nnx.Module):
    def __init__(self, norm, rngs):
        self.up = nnx.Linear(32, N, rngs=rngs)
        self.norm = norm(N, rngs=rngs)
        self.down = nnx.Linear(N, 16, rngs=rngs)

    def __call__(self, x):
        return self.down(self.norm(self.up(x)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("param_dtype", [f32, bf16])
def test_nnx_grad_through_model(kind, param_dtype, quack_calls):
    cls, fn = KINDS[kind]

    ours, theirs = (
        NNXModel(
            lambda n, rngs, m=m: getattr(m, cls)(n, param_dtype=param_dtype, rngs=rngs), nnx.Rngs(0)
        )
        for m in (qnnx, nnx)
    )
    assert_same_tree(nnx.state(ours), nnx.state(theirs))
    nnx.update(theirs, perturbed(nnx.state(theirs)))
    nnx.update(ours, nnx.state(theirs))
    x = inputs(f32, (4, 6, 32))

    def loss(model, x):
        return jnp.sum(jnp.square(model(x)))

    quack_calls.clear()
    ours_grads = nnx.grad(loss, argnums=(0, 1))(ours, x)
    assert quack_calls == [fn]
    theirs_grads = nnx.grad(loss, argnums=(0, 1))(theirs, x)
    assert jax.tree.structure(ours_grads) == jax.tree.structure(theirs_grads)
    for a, b in zip(jax.tree.leaves(ours_grads), jax.tree.leaves(theirs_grads), strict=True):
        scale = float(jnp.max(jnp.abs(b.astype(f32))))
        tol = 1e-4 if a.dtype == f32 else 2e-2
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol, atol=tol * scale)


# -- packaging ----------------------------------------------------------------------


def test_import_quack_jax_does_not_import_flax():
    code = "import sys, quack_jax; assert 'flax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
