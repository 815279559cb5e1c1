"""quack_jax.flax against Flax: the norms against Flax's own (the same parameters, outputs,
dtypes and grads), the LM-head losses against cross_entropy of Flax's logits. Values are
compared with ``checks.assert_close`` at the dtype the math runs in."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close

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


def size(ref):
    """|ref| plus its largest element: both sides compute in the same dtype, in another
    order, and each element's terms reach the largest element in size."""
    ref = np.abs(np.float32(ref))
    return ref + np.max(ref, initial=0.0)


def assert_same(ours, theirs, what="", dtype=None):
    """Our result is Flax's: the same shape and dtype, values within ``checks.TOL`` of
    ``dtype`` (default their dtype, which the math runs in)."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
    assert_close(ours, theirs, size(theirs), dtype or theirs.dtype.name, what)


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
        assert_same(ours.apply(variables, x), theirs.apply(variables, x))
        assert_same(jax.jit(ours.apply)(variables, x), theirs.apply(variables, x))
    assert quack_calls == [fn] * 4 * fast


@pytest.mark.parametrize("kind", KINDS)
def test_linen_mask_and_axis_name_use_flax(kind, quack_calls):
    cls, _ = KINDS[kind]
    x = inputs(f32)
    variables = perturbed(getattr(nn, cls)().init(jax.random.key(0), x))
    mask = jnp.arange(N) < N // 2
    assert_same(
        getattr(qnn, cls)().apply(variables, x, mask=mask),
        getattr(nn, cls)().apply(variables, x, mask=mask),
    )

    def per_row(module):
        return jax.vmap(lambda r: module.apply(variables, r), axis_name="rows")(x)

    assert_same(
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
        assert_same(a, b, "grad")


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
    assert_same(ours(x), theirs(x))
    nnx.update(theirs, perturbed(nnx.state(theirs)))
    nnx.update(ours, nnx.state(theirs))
    assert_same(ours(x), theirs(x))
    assert_same(nnx.jit(lambda m, x: m(x))(ours, x), theirs(x))
    assert quack_calls == [fn] * 3 * fast


@pytest.mark.parametrize("kind", KINDS)
def test_nnx_mask_uses_flax(kind, quack_calls):
    cls, _ = KINDS[kind]
    ours, theirs = nnx_pair(cls, {})
    x, mask = inputs(f32), jnp.arange(N) < N // 2
    assert_same(ours(x, mask=mask), theirs(x, mask=mask))
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
        assert_same(a, b, "grad")


# -- float64 requested with x64 off --------------------------------------------------


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")  # Flax's init
@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("kind", KINDS)
def test_float64_dtype_without_x64(kind, framework, quack_calls):
    """dtype=float64 with x64 off is float32, as in Flax's module: quack_jax computes it,
    with JAX's warning, and gives Flax's float32 output."""
    cls, fn = KINDS[kind]
    with jax.enable_x64(False):
        x = inputs(f32)
        if framework == "linen":
            ours, theirs = (getattr(m, cls)(dtype=jnp.float64) for m in (qnn, nn))
            variables = perturbed(theirs.init(jax.random.key(0), x))
            with pytest.warns(UserWarning, match="float64"):
                want = theirs.apply(variables, x)
            quack_calls.clear()
            with pytest.warns(UserWarning, match="float64"):
                got = ours.apply(variables, x)
        else:
            ours, theirs = nnx_pair(cls, {"dtype": jnp.float64})
            nnx.update(theirs, perturbed(nnx.state(theirs)))
            nnx.update(ours, nnx.state(theirs))
            with pytest.warns(UserWarning, match="float64"):
                want = theirs(x)
            quack_calls.clear()
            with pytest.warns(UserWarning, match="float64"):
                got = ours(x)
    assert want.dtype == f32
    assert_same(got, want)
    assert quack_calls == [fn]


# -- residual= : a pre-norm block's add and norm -------------------------------------


def stock_with_residual(norm):
    """The stock module's call with a residual, as a block writes it without quack_jax."""

    def call(x, residual):
        h = x + residual
        return norm(h), h

    return call


# (x's dtype, the residual's dtype, the module's arguments, whether quack_jax computes it
# in linen and in nnx)
RESIDUAL_CASES = [
    (bf16, bf16, {"param_dtype": bf16}, True, True),
    (bf16, bf16, {"dtype": bf16}, True, True),
    (f32, f32, {}, True, True),
    (bf16, bf16, {}, True, False),  # nnx promotes x to the float32 scale, the add does not
    (f32, f32, {"dtype": bf16}, True, False),  # nnx casts x to bfloat16, the add does not
    (bf16, f32, {}, False, False),  # the add promotes: the stream is float32
]


@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("x_dtype, r_dtype, kwargs, linen_fast, nnx_fast", RESIDUAL_CASES)
def test_residual_matches_the_add_then_the_norm(
    kind, framework, x_dtype, r_dtype, kwargs, linen_fast, nnx_fast, quack_calls
):
    """``norm(x, residual=r)`` is ``(norm(x + r), x + r)``: values, dtypes and the
    gradients of the parameters, x and r through both results; quack_jax computes it
    where r has x's dtype and the module computes on x as it is, and Flax's own code
    elsewhere."""
    cls, fn = KINDS[kind]
    x, r = inputs(x_dtype), inputs(r_dtype, seed=2)
    if framework == "linen":
        fast = linen_fast
        ours, theirs = (getattr(m, cls)(**kwargs) for m in (qnn, nn))
        params = perturbed(theirs.init(jax.random.key(0), x))

        def ours_fn(p, x, r):
            return ours.apply(p, x, residual=r)

        def theirs_fn(p, x, r):
            return stock_with_residual(lambda h: theirs.apply(p, h))(x, r)

    else:
        fast = nnx_fast
        ours_m, theirs_m = nnx_pair(cls, kwargs)
        nnx.update(theirs_m, perturbed(nnx.state(theirs_m)))
        nnx.update(ours_m, nnx.state(theirs_m))
        graphdef, params = nnx.split(ours_m)
        theirs_graphdef = nnx.graphdef(theirs_m)

        def ours_fn(p, x, r):
            return nnx.merge(graphdef, p)(x, residual=r)

        def theirs_fn(p, x, r):
            return stock_with_residual(nnx.merge(theirs_graphdef, p))(x, r)

    quack_calls.clear()
    got = ours_fn(params, x, r)
    want = theirs_fn(params, x, r)
    for a, b in zip(got, want, strict=True):
        assert_same(a, b)

    def loss(fn):
        def of(p, x, r):
            y, h = fn(p, x, r)
            return jnp.sum(jnp.square(y.astype(f32))) + jnp.sum(jnp.sin(h.astype(f32)))

        return jax.grad(of, argnums=(0, 1, 2))

    got_grads = loss(ours_fn)(params, x, r)
    assert quack_calls == [fn] * 2 * fast
    want_grads = loss(theirs_fn)(params, x, r)
    assert jax.tree.structure(got_grads) == jax.tree.structure(want_grads)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        assert_same(a, b, "grad")


@pytest.mark.parametrize("kind", KINDS)
def test_residual_with_a_mask_or_another_shape_uses_flax(kind, quack_calls):
    """A mask, a residual that broadcasts against x, or an x without a dtype (a list) is
    Flax's norm of ``x + residual``."""
    cls, _ = KINDS[kind]
    x, mask = inputs(f32), jnp.arange(N) < N // 2
    ours, theirs = nnx_pair(cls, {})
    r = inputs(f32, seed=2)
    for a, b in zip(ours(x.tolist(), residual=r), stock_with_residual(theirs)(x, r), strict=True):
        assert_same(a, b)
    variables = perturbed(getattr(nn, cls)().init(jax.random.key(0), x))
    for r, kwargs in ((inputs(f32, seed=2), {"mask": mask}), (inputs(f32, (N,), seed=3), {})):
        got = ours(x, residual=r, **kwargs)
        want = stock_with_residual(lambda h, kwargs=kwargs: theirs(h, **kwargs))(x, r)
        for a, b in zip(got, want, strict=True):
            assert_same(a, b)
        got = getattr(qnn, cls)().apply(variables, x, residual=r, **kwargs)
        want = stock_with_residual(
            lambda h, kwargs=kwargs: getattr(nn, cls)().apply(variables, h, **kwargs)
        )(x, r)
        for a, b in zip(got, want, strict=True):
            assert_same(a, b)
    assert quack_calls == []


# -- packaging ----------------------------------------------------------------------


def test_import_quack_jax_does_not_import_flax():
    code = "import sys, quack_jax; assert 'flax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# In a fresh Python: the modules named ``blocked`` fail to import (those that ``import
# flax`` has not already imported itself), then ``quack_jax.flax.<module>`` is imported
# and used.
WITHOUT_THE_OTHER = """
import importlib.abc, sys
import flax
import jax.numpy as jnp
blocked = [name for name in {blocked!r} if name not in sys.modules]

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            raise ImportError(name + " is blocked")

sys.meta_path.insert(0, Blocker())
from quack_jax.flax import {module}
{use}
assert not [b for b in blocked if b in sys.modules], blocked
"""
USES = {
    "linen": "import jax; linen.RMSNorm().init_with_output(jax.random.key(0), jnp.ones((2, 8)))",
    "nnx": "from flax import nnx as fnnx; nnx.RMSNorm(8, rngs=fnnx.Rngs(0))(jnp.ones((2, 8)))",
}


@pytest.mark.parametrize(
    "module, blocked",
    [
        ("linen", ["flax.nnx", "quack_jax.flax.nnx"]),
        ("nnx", ["flax.linen", "quack_jax.flax.linen"]),
    ],
)
def test_linen_and_nnx_import_without_each_other(module, blocked):
    """quack_jax.flax.linen imports and runs where flax.nnx cannot be imported, and
    quack_jax.flax.nnx where quack_jax.flax.linen (and flax.linen, unless ``import
    flax`` imports it) cannot."""
    code = WITHOUT_THE_OTHER.format(blocked=blocked, module=module, use=USES[module])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_linen_does_not_import_flax_nnx():
    code = "import sys\nfrom quack_jax.flax import linen\nassert 'flax.nnx' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- LM heads: linear_cross_entropy against the Flax head and cross_entropy -----------------

D, V = 16, 40
LOSS_CASES = {
    "mean": {},
    "none": {"reduction": "none"},
    "sum-smooth-zloss": {"reduction": "sum", "label_smoothing": 0.1, "z_loss": 1e-3},
    "none-lse-softcap-ignore": {
        "reduction": "none",
        "return_lse": True,
        "logit_softcap": 5.0,
        "ignore_index": 3,
    },
}
SHORT = ("mean", "none-lse-softcap-ignore")  # the heads whose other paths are tested
CHUNKED = {"chunk_size": 4}  # 15 rows: three chunks and a remainder
HEAD_DTYPES = {"f32": {}, "bf16": {"dtype": bf16, "param_dtype": f32}}


def head_cases(*heads, options=tuple(LOSS_CASES)):
    """pytest parameters (head, dtype, options) for these heads: each loss option in f32
    and with a bfloat16 module (float32 parameters)."""
    return [
        pytest.param(h, d, LOSS_CASES[o], id=f"{h}-{d}-{o}")
        for h in heads
        for d in HEAD_DTYPES
        for o in options
    ]


def head_data(shape=(3, 5), options=None):
    """Inputs, labels (a row ignored by ignore_index, the default -100 or the options')
    and weights of the per-row losses."""
    x = inputs(f32, (*shape, D))
    labels = jax.random.randint(jax.random.key(2), shape, 0, V)
    labels = labels.at[0, 1].set((options or {}).get("ignore_index", -100))
    weights = jax.random.uniform(jax.random.key(3), shape, minval=0.5, maxval=1.5)
    return x, labels, weights


def scalar(out, weights):
    """A loss to differentiate: the loss (and lse), per-row ones weighted."""
    return sum(jnp.sum(o * weights) if o.ndim else o for o in jax.tree.leaves(out))


def assert_loss_and_grads(ours, theirs, args, weights, bf16_math):
    """ours(*args) and theirs(*args) agree, and so do the gradients of their losses with
    respect to every argument (a tree of parameters, the inputs)."""
    out, ref = ours(*args), theirs(*args)
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    math = "bfloat16" if bf16_math else "float32"
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert b.dtype == f32
        assert_same(a, b, "loss", math)

    def grads(f):
        return jax.grad(lambda *a: scalar(f(*a), weights), argnums=tuple(range(len(args))))(*args)

    g_ours, g_ref = grads(ours), grads(theirs)
    assert jax.tree.structure(g_ours) == jax.tree.structure(g_ref)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref), strict=True):
        assert np.any(b != 0)
        assert_same(a, b, "grad", math)


@pytest.fixture
def lce_calls(monkeypatch):
    """The keyword arguments of each quack_jax.linear_cross_entropy call."""
    calls = []
    real = quack_jax.linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(quack_jax, "linear_cross_entropy", spy)
    return calls


NNX_HEADS = {
    "linear": lambda rngs, **kw: nnx.Linear(D, V, rngs=rngs, **kw),
    "linear-nobias": lambda rngs, **kw: nnx.Linear(D, V, use_bias=False, rngs=rngs, **kw),
    "embed": lambda rngs, **kw: nnx.Embed(V, D, rngs=rngs, **kw),
}


def nnx_logits(module, x):
    return module.attend(x) if isinstance(module, nnx.Embed) else module(x)


def nnx_head(kind, dtype_kw, **kw):
    module = NNX_HEADS[kind](nnx.Rngs(0), **dtype_kw, **kw)
    nnx.update(module, perturbed(nnx.state(module)))  # a bias that is not zero
    return module


def nnx_fns(module, labels, options, chunked=CHUNKED):
    graphdef, params = nnx.split(module)
    ce = {k: v for k, v in options.items() if k != "chunk_size"}

    def ours(params, x):
        m = nnx.merge(graphdef, params)
        return qnnx.linear_cross_entropy(m, x, labels, **options, **chunked)

    def theirs(params, x):
        return quack_jax.cross_entropy(nnx_logits(nnx.merge(graphdef, params), x), labels, **ce)

    return ours, theirs, params


@pytest.mark.parametrize(
    "kind, dtype, options",
    head_cases("linear", "embed") + head_cases("linear-nobias", options=SHORT),
)
def test_nnx_linear_cross_entropy(kind, dtype, options, lce_calls):
    module = nnx_head(kind, HEAD_DTYPES[dtype])
    x, labels, weights = head_data(options=options)
    ours, theirs, params = nnx_fns(module, labels, options)
    assert_loss_and_grads(ours, theirs, (params, x), weights, dtype == "bf16")
    transpose = kind == "embed"
    call = lce_calls[0]
    assert call["transpose_weight"] is transpose and call["chunk_size"] == 4
    assert (call["bias"] is None) == (kind != "linear")
    assert call.get("precision") is None and call.get("preferred_element_type") is None


@pytest.mark.parametrize("kind", NNX_HEADS)
def test_nnx_linear_cross_entropy_jit(kind):
    module = nnx_head(kind, HEAD_DTYPES["bf16"])
    x, labels, _ = head_data((2, 7))

    @nnx.jit
    def both(module, x):
        return (
            qnnx.linear_cross_entropy(module, x, labels),
            quack_jax.cross_entropy(nnx_logits(module, x), labels),
        )

    ours, ref = both(module, x)
    assert_same(ours, ref, "loss", "bfloat16")


def test_nnx_linear_precision_and_preferred_type(lce_calls):
    kw = {"precision": jax.lax.Precision.HIGHEST, "preferred_element_type": f32}
    module = nnx_head("linear", {"dtype": bf16}, **kw)
    x, labels, weights = head_data()
    ours, theirs, params = nnx_fns(module, labels, {"reduction": "none"})
    assert module(x).dtype == f32
    assert_loss_and_grads(ours, theirs, (params, x), weights, True)
    assert lce_calls[0]["precision"] == jax.lax.Precision.HIGHEST
    assert lce_calls[0]["preferred_element_type"] == f32


class TiedEmbed(nnx.Embed):
    def attend(self, query):
        return super().attend(query) / 2


def test_nnx_linear_cross_entropy_refuses_what_it_cannot_compute():
    x, labels, _ = head_data()
    rngs = nnx.Rngs(0)

    def refused(module, match, x=x):
        with pytest.raises(ValueError, match=match):
            qnnx.linear_cross_entropy(module, x, labels)

    def scaled_dot(*args, **kwargs):
        return 2 * jax.lax.dot_general(*args, **kwargs)

    refused(nnx.Linear(D, V, dot_general=scaled_dot, rngs=rngs), "dot_general")
    refused(nnx.Linear(D, V, preferred_element_type=bf16, rngs=rngs), "preferred_element_type")
    refused(nnx.Linear(D, V, preferred_element_type=jnp.int32, rngs=rngs), "preferred_element")
    refused(nnx.LoRALinear(D, V, lora_rank=2, rngs=rngs), r"overrides Linear\.__call__")
    refused(TiedEmbed(V, D, rngs=rngs), r"overrides Embed\.attend")
    refused(nnx.LinearGeneral(D, V, rngs=rngs), r"nnx\.Linear or an nnx\.Embed")
    refused(nnx.Linear(D, V, rngs=rngs), r"shape \(\.\.\., 16\)", x[..., :8])
    refused(nnx.Embed(V, D, rngs=rngs), r"shape \(\.\.\., 16\)", x[0, 0, 0])
    with pytest.raises(TypeError, match="precision"):
        qnnx.linear_cross_entropy(nnx.Linear(D, V, rngs=rngs), x, labels, precision="highest")
    # what is refused is what Flax would compute differently: this one it computes alike
    module = nnx.Linear(D, V, use_bias=False, preferred_element_type=bf16, rngs=rngs)
    assert_same(
        qnnx.linear_cross_entropy(module, x, labels),
        quack_jax.cross_entropy(module(x), labels),
        "loss",
    )


# linen


class DenseLM(nn.Module):
    """A head over a projection: Dense or DenseCrossEntropy named "head"."""

    head: type
    use_bias: bool = True
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, name="proj")(x)
        return self.head(V, use_bias=self.use_bias, dtype=self.dtype, name="head"), x


LINEN_HEADS = {"dense": True, "dense-nobias": False}


@pytest.mark.parametrize("use_bias", LINEN_HEADS.values(), ids=LINEN_HEADS)
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"param_dtype": bf16, "kernel_init": nn.initializers.normal(0.3)},
        {"bias_init": nn.initializers.normal(0.5), "dtype": bf16},
    ],
    ids=["default", "bf16-params-normal", "bias-init"],
)
def test_dense_cross_entropy_params_match_dense(use_bias, kwargs):
    x, labels, _ = head_data()
    ours = qnn.DenseCrossEntropy(V, use_bias=use_bias, **kwargs)
    theirs = nn.Dense(V, use_bias=use_bias, **kwargs)
    assert_same_tree(ours.init(jax.random.key(4), x, labels), theirs.init(jax.random.key(4), x))


def test_dense_cross_entropy_loads_a_dense_checkpoint():
    class LM(nn.Module):
        fused: bool

        @nn.compact
        def __call__(self, x, labels):
            h = nn.Dense(D, name="proj")(x)
            if self.fused:
                return qnn.DenseCrossEntropy(V, name="head")(h, labels)
            return quack_jax.cross_entropy(nn.Dense(V, name="head")(h), labels)

    x, labels, _ = head_data()
    checkpoint = perturbed(LM(False).init(jax.random.key(0), x, labels))
    assert_same_tree(
        LM(True).init(jax.random.key(0), x, labels), LM(False).init(jax.random.key(0), x, labels)
    )
    assert_same(
        LM(True).apply(checkpoint, x, labels), LM(False).apply(checkpoint, x, labels), "loss"
    )


@pytest.mark.parametrize("kind, dtype, options", head_cases(*LINEN_HEADS, options=SHORT))
def test_linen_dense_cross_entropy(kind, dtype, options, lce_calls):
    use_bias = LINEN_HEADS[kind]
    x, labels, weights = head_data(options=options)
    kw = dict(use_bias=use_bias, **HEAD_DTYPES[dtype])
    ours, theirs = qnn.DenseCrossEntropy(V, **kw), nn.Dense(V, **kw)
    params = perturbed(theirs.init(jax.random.key(0), x))
    ce = {k: v for k, v in options.items() if k != "chunk_size"}
    assert_loss_and_grads(
        lambda p, x: ours.apply(p, x, labels, **options, **CHUNKED),
        lambda p, x: quack_jax.cross_entropy(theirs.apply(p, x), labels, **ce),
        (params, x),
        weights,
        dtype == "bf16",
    )
    call = lce_calls[0]
    assert call["transpose_weight"] is False and call["chunk_size"] == 4
    assert (call["bias"] is None) != use_bias and call["precision"] is None


def test_linen_dense_cross_entropy_precision_and_refusals(lce_calls):
    x, labels, _ = head_data()
    kw = {"precision": "highest"}
    params = nn.Dense(V, **kw).init(jax.random.key(0), x)
    assert_same(
        qnn.DenseCrossEntropy(V, **kw).apply(params, x, labels),
        quack_jax.cross_entropy(nn.Dense(V, **kw).apply(params, x), labels),
        "loss",
    )
    assert lce_calls[0]["precision"] == "highest"

    def scaled_dot(*args, **kwargs):
        return 2 * jax.lax.dot_general(*args, **kwargs)

    with pytest.raises(ValueError, match="dot_general"):
        qnn.DenseCrossEntropy(V, dot_general=scaled_dot).apply(params, x, labels)
    with pytest.raises(TypeError, match="bias"):
        qnn.DenseCrossEntropy(V).apply(params, x, labels, bias=None)


class TiedLM(nn.Module):
    """An embedding whose table is also the LM head."""

    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = f32

    def setup(self):
        self.embed = nn.Embed(V, D, dtype=self.dtype, param_dtype=self.param_dtype)

    def logits(self, x):
        return self.embed.attend(x)

    def loss(self, x, labels, **kwargs):
        return qnn.embed_cross_entropy(self.embed, x, labels, **kwargs)


@pytest.mark.parametrize("kind, dtype, options", head_cases("embed", options=SHORT))
def test_linen_embed_cross_entropy(kind, dtype, options, lce_calls):
    x, labels, weights = head_data(options=options)
    model = TiedLM(**HEAD_DTYPES[dtype])
    params = perturbed(model.init(jax.random.key(0), labels, method=lambda m, t: m.embed(t)))
    ce = {k: v for k, v in options.items() if k != "chunk_size"}

    def ours(p, x):
        return model.apply(p, x, labels, **options, **CHUNKED, method=TiedLM.loss)

    def theirs(p, x):
        return quack_jax.cross_entropy(model.apply(p, x, method=TiedLM.logits), labels, **ce)

    assert_loss_and_grads(ours, theirs, (params, x), weights, dtype == "bf16")
    call = lce_calls[0]
    assert call["transpose_weight"] is True and call["bias"] is None and "precision" not in call


def test_linen_embed_cross_entropy_bound_and_refusals():
    x, labels, _ = head_data()
    embed = nn.Embed(V, D)
    variables = perturbed(embed.init(jax.random.key(0), labels))
    assert_same(
        qnn.embed_cross_entropy(embed.bind(variables), x, labels, reduction="none"),
        quack_jax.cross_entropy(
            embed.apply(variables, x, method="attend"), labels, reduction="none"
        ),
        "loss",
    )
    with pytest.raises(ValueError, match="unbound"):
        qnn.embed_cross_entropy(embed, x, labels)
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 16\)"):
        qnn.embed_cross_entropy(embed.bind(variables), x[..., :4], labels)
    with pytest.raises(ValueError, match=r"flax\.linen\.Embed"):
        qnn.embed_cross_entropy(nn.Dense(V), x, labels)

    class Scaled(nn.Embed):
        def attend(self, query):
            return super().attend(query) / 2

    with pytest.raises(ValueError, match=r"overrides Embed\.attend"):
        qnn.embed_cross_entropy(Scaled(V, D).bind(variables), x, labels)
