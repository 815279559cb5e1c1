"""rms_norm / layer_norm through the XLA fallback (CPU): values and gradients against
float64 references, empty and float64 inputs, transforms, bad input, sharding on the 8
host devices, and the CUDA lowering (compiled kernels, no GPU needed)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import quack_jax
from quack_jax import _cache, _ffi

RNG = np.random.default_rng()
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3, "float64": 1e-12}
OPS = {"rms_norm": quack_jax.rms_norm, "layer_norm": quack_jax.layer_norm}
DTYPES = ["float32", "bfloat16", "float16"]


# -- references (float64 numpy, independent of quack_jax) -----------------------------


def f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def np_h(x, residual):
    """The h returned with prenorm: x, or x + residual rounded to x's dtype."""
    if residual is None:
        return np.asarray(x)
    return (f64(x) + f64(residual)).astype(np.asarray(x).dtype)


def np_hn(x, residual):
    """The h that is normalised: the h returned, in float64."""
    return f64(np_h(x, residual))


def np_stats(h, rms, eps):
    h = f64(h)
    centred = h if rms else h - h.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt((centred * centred).mean(axis=-1, keepdims=True) + eps)
    return centred * rstd, rstd


def np_norm(h, weight, bias, *, rms, eps, offset):
    y, _ = np_stats(h, rms, eps)
    if weight is not None:
        y = y * (f64(weight) + offset)
    if bias is not None:
        y = y + f64(bias)
    return y


def np_grads(h, weight, bias, dy, dh, *, rms, eps, offset):
    """Float64 (dx, dweight, dbias) for cotangents dy of y and dh of h (or None).
    dx is also the residual's gradient. test_np_grads_match_jax_grad checks this formula
    against jax.grad of a float64 implementation."""
    xhat, rstd = np_stats(h, rms, eps)
    dy = f64(dy)
    g = dy if weight is None else dy * (f64(weight) + offset)
    dx = g - xhat * (g * xhat).mean(axis=-1, keepdims=True)
    if not rms:
        dx = dx - g.mean(axis=-1, keepdims=True)
    dx = dx * rstd
    if dh is not None:
        dx = dx + f64(dh)
    axes = tuple(range(dy.ndim - 1))
    dw = None if weight is None else (dy * xhat).sum(axis=axes)
    db = None if bias is None else dy.sum(axis=axes)
    return dx, dw, db


def np_dx_scale(h, weight, dy, dh, *, rms, eps, offset):
    """The size of the terms that make dx, rstd * |dy * (w + offset)| (+ |dh|): what
    its error is judged against (for LayerNorm of a row of one, dx from y is 0 but
    it is the difference of such terms)."""
    _, rstd = np_stats(h, rms, eps)
    g = np.abs(f64(dy)) * (1.0 if weight is None else np.abs(f64(weight) + offset))
    return np.max(g * rstd + (0.0 if dh is None else np.abs(f64(dh))), initial=0.0)


def jax64_grads(h, weight, bias, dy, dh, *, rms, eps, offset):
    """The same by jax.vjp of a float64 jnp implementation (slow: compiles per shape)."""
    with jax.enable_x64(True):

        def fn(h, w, b):
            centred = h if rms else h - jnp.mean(h, axis=-1, keepdims=True)
            y = centred / jnp.sqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
            if w is not None:
                y = y * (w + offset)
            if b is not None:
                y = y + b
            return y

        args = [None if a is None else jnp.asarray(f64(a)) for a in (h, weight, bias)]
        _, vjp = jax.vjp(fn, *args)
        dx, dw, db = vjp(jnp.asarray(f64(dy)))
        if dh is not None:
            dx = dx + jnp.asarray(f64(dh))
        return [None if g is None else np.asarray(g) for g in (dx, dw, db)]


def random(shape, dtype, scale=1.0, shift=0.0, as_float32=False):
    """Random values of ``dtype`` (as float32 with ``as_float32``), made in numpy."""
    values = (scale * RNG.standard_normal(shape) + shift).astype(np.float32)
    values = values.astype(jnp.dtype(dtype))
    return jnp.asarray(values.astype(np.float32) if as_float32 else values)


def assert_close(out, ref, dtype, label="", scale=0.0):
    """Within TOL[dtype] of the largest of |ref| and ``scale``."""
    out = np.asarray(out).astype(np.float64)
    assert out.shape == ref.shape, label
    scale = max(np.max(np.abs(ref), initial=0.0), scale)
    np.testing.assert_allclose(
        out, ref, rtol=TOL[dtype], atol=TOL[dtype] * max(scale, 1e-30), err_msg=label
    )


def call(name, x, r, w, b, **kwargs):
    fn = OPS[name]
    if name == "layer_norm":
        return fn(x, w, b, residual=r, **kwargs)
    assert b is None
    return fn(x, w, residual=r, **kwargs)


@dataclasses.dataclass
class Case:
    """One call: random operands as ``config`` asks (weight and bias dtypes, "x" for x's
    dtype; residual; the keyword arguments), cotangents, and the float64 references."""

    name: str
    dtype: str
    shape: tuple
    config: dict

    def __post_init__(self):
        config, n, dtype = dict(self.config), self.shape[-1], self.dtype
        dt = lambda k: dtype if config.get(k) == "x" else config.get(k)  # noqa: E731
        self.rms = self.name == "rms_norm"
        # a mean offset, so that LayerNorm's centring matters
        self.x = random(self.shape, dtype, 3.0, 1.5)
        self.r = random(self.shape, dtype, 2.0) if config.get("residual") else None
        self.w = None if dt("weight") is None else random((n,), dt("weight"), 1.0, 0.5)
        self.b = None if self.rms or dt("bias") is None else random((n,), dt("bias"))
        keys = ("eps", "prenorm", "weight_offset", "out_dtype")
        self.kwargs = {k: config[k] for k in keys if k in config}
        self.prenorm = self.kwargs.get("prenorm", False)
        self.out_dtype = jnp.dtype(self.kwargs.get("out_dtype", dtype)).name
        self.eps = self.kwargs.get("eps", 1e-6)
        self.offset = self.kwargs.get("weight_offset", 0.0)
        # cotangents representable in the output dtypes, so that the casts are exact
        self.gy = random(self.shape, self.out_dtype, as_float32=True)
        self.gh = random(self.shape, dtype, as_float32=True) if self.prenorm else None
        self.label = f"{self.name} {dtype} {self.shape} {self.config}"

    @property
    def operands(self):
        return (self.x, self.r, self.w, self.b)

    def __call__(self, x, r, w, b):
        return call(self.name, x, r, w, b, **self.kwargs)

    def loss(self, x, r, w, b):
        out = self(x, r, w, b)
        y, h = out if self.prenorm else (out, None)
        value = jnp.sum(y.astype(jnp.float32) * self.gy)
        return value if h is None else value + jnp.sum(h.astype(jnp.float32) * self.gh)

    def check_forward(self, out):
        y, h = out if self.prenorm else (out, None)
        assert y.shape == self.x.shape and y.dtype == jnp.dtype(self.out_dtype), self.label
        if self.prenorm:
            assert h.shape == self.x.shape and h.dtype == self.x.dtype, self.label
            np.testing.assert_array_equal(np.asarray(h), np_h(self.x, self.r), err_msg=self.label)
        h_ref = np_hn(self.x, self.r)
        ref = np_norm(h_ref, self.w, self.b, rms=self.rms, eps=self.eps, offset=self.offset)
        # the sum is exact and the math float32: the error is that of rounding to y's dtype
        assert_close(y, ref, self.out_dtype, self.label)

    def check_grads(self, grads):
        dx, dr, dw, db = grads
        kw = dict(rms=self.rms, eps=self.eps, offset=self.offset)
        h = np_hn(self.x, self.r)
        refs = np_grads(h, self.w, self.b, self.gy, self.gh, **kw)
        dx_scale = np_dx_scale(h, self.w, self.gy, self.gh, **kw)
        assert dx.dtype == self.x.dtype, self.label
        assert_close(dx, refs[0], self.dtype, f"dx: {self.label}", dx_scale)
        if self.r is None:
            assert dr is None
        else:
            assert dr.dtype == self.r.dtype, self.label
            np.testing.assert_array_equal(np.asarray(dr), np.asarray(dx), err_msg=self.label)
        for key, grad, ref, operand in (("dw", dw, refs[1], self.w), ("db", db, refs[2], self.b)):
            if operand is None:
                assert grad is None, self.label
            else:
                assert grad.shape == operand.shape and grad.dtype == operand.dtype, self.label
                assert_close(grad, ref, operand.dtype.name, f"{key}: {self.label}")


def make_inputs(name, dtype, shape, **config):
    """x, residual, weight, bias (None where absent; no bias for rms_norm)."""
    return Case(name, dtype, shape, config).operands


def run_forward(cases, jit=True):
    """All cases in one jitted function (one compile)."""
    fn = lambda ops: [c(*o) for c, o in zip(cases, ops, strict=True)]  # noqa: E731
    outs = (jax.jit(fn) if jit else fn)([c.operands for c in cases])
    for case, out in zip(cases, outs, strict=True):
        case.check_forward(out)


def run_grads(cases):
    """The gradients of all cases' losses w.r.t. all operands, in one jitted function."""

    def total(ops):
        return sum(c.loss(*o) for c, o in zip(cases, ops, strict=True))

    grads = jax.jit(jax.grad(total))([c.operands for c in cases])
    for case, g in zip(cases, grads, strict=True):
        case.check_grads(g)


# -- forward --------------------------------------------------------------------------

FORWARD_CONFIGS = {
    "plain": {},
    "weight": dict(weight="x"),
    "weight_f32": dict(weight="float32"),
    "weight_offset": dict(weight="x", weight_offset=1.0),
    "bias": dict(weight="float32", bias="x"),
    "bias_only": dict(bias="float32"),
    "eps": dict(weight="x", eps=0.5),
    "residual": dict(residual=True),
    "residual_prenorm": dict(residual=True, prenorm=True, weight="x"),
    "prenorm": dict(prenorm=True),
    "out_f32": dict(out_dtype="float32", weight="x"),
    "out_bf16": dict(out_dtype=jnp.bfloat16, bias="x"),
    "all": dict(
        weight="float32",
        bias="float32",
        residual=True,
        prenorm=True,
        weight_offset=1.0,
        out_dtype="float32",
        eps=1e-3,
    ),
}


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_configs_match_float64(name, dtype):
    run_forward([Case(name, dtype, (3, 257), c) for c in FORWARD_CONFIGS.values()])


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 128, 1000, 5000])
def test_forward_shapes_match_float64(name, dtype, n):
    """Each leading shape with one of three configurations, rotating with n."""
    leads, configs = [(), (3,), (2, 5)], ["plain", "all", "residual_prenorm"]
    k = [1, 7, 128, 1000, 5000].index(n)
    cases = [
        Case(name, dtype, (*lead, n), FORWARD_CONFIGS[configs[(i + k) % 3]])
        for i, lead in enumerate(leads)
    ]
    run_forward(cases)


@pytest.mark.parametrize("name", OPS)
def test_forward_eager(name):
    run_forward([Case(name, "bfloat16", (2, 3, 100), FORWARD_CONFIGS["all"])], jit=False)


def test_eps_is_added_inside_the_root():
    """A constant row: y = (h - mean) * rsqrt(var + eps) exposes where eps goes."""
    x = jnp.full((2, 64), 2.0, jnp.float32)
    np.testing.assert_allclose(quack_jax.rms_norm(x, eps=5.0), 2.0 / 3.0, rtol=1e-6)
    np.testing.assert_array_equal(quack_jax.layer_norm(x, eps=5.0), 0.0)
    w = jnp.full((64,), 3.0, jnp.float32)
    np.testing.assert_allclose(
        quack_jax.rms_norm(x, w, eps=5.0, weight_offset=1.0), 4 * 2.0 / 3.0, rtol=1e-6
    )


def test_residual_sum_is_rounded_before_normalising():
    """bfloat16: 256 + 1 rounds to 256, in the h returned and in the h normalised, as
    an unfused ``x + residual`` in bfloat16 would."""
    x = jnp.asarray([[256.0, -256.0, 0.0, 0.0]], jnp.bfloat16)
    r = jnp.asarray([[1.0, 0.0, 0.0, 0.0]], jnp.bfloat16)
    y, h = quack_jax.rms_norm(x, residual=r, prenorm=True, out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(h, np.float32), [[256.0, -256.0, 0.0, 0.0]])
    rms = np.sqrt((256.0**2 + 256.0**2) / 4)
    np.testing.assert_allclose(y, [[256.0 / rms, -256.0 / rms, 0.0, 0.0]], rtol=1e-6)


# -- gradients ------------------------------------------------------------------------

GRAD_CONFIGS = {
    "plain": {},
    "weight": dict(weight="x"),
    "weight_f32_offset": dict(weight="float32", bias="float32", weight_offset=1.0),
    "bias_x": dict(weight="x", bias="x"),
    "bias_only": dict(bias="float32"),
    "prenorm": dict(prenorm=True, weight="float32", bias="x"),
    "out_f32": dict(weight="x", out_dtype="float32", eps=1e-2),
}
RESIDUAL_GRAD_CONFIGS = {
    "residual": dict(residual=True, weight="x", bias="x"),
    "residual_prenorm": dict(residual=True, prenorm=True, weight="float32", bias="x"),
    "all": dict(
        weight="float32",
        bias="float32",
        residual=True,
        prenorm=True,
        weight_offset=1.0,
        out_dtype="float32",
        eps=1e-2,
    ),
}


@pytest.mark.parametrize("name", OPS)
def test_np_grads_match_jax_grad(name):
    """The analytic float64 gradients the tests use, against jax.grad in float64."""
    for shape, config in (((3, 40), RESIDUAL_GRAD_CONFIGS["all"]), ((2, 2, 7), {"prenorm": True})):
        c = Case(name, "float32", shape, config)
        args = (np_hn(c.x, c.r), c.w, c.b, c.gy, c.gh)
        kw = dict(rms=c.rms, eps=c.eps, offset=c.offset)
        for ours, theirs in zip(np_grads(*args, **kw), jax64_grads(*args, **kw), strict=True):
            assert (ours is None) == (theirs is None)
            if ours is not None:
                np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_float64(name, dtype):
    run_grads([Case(name, dtype, (2, 5, 300), c) for c in GRAD_CONFIGS.values()])


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_shapes_match_float64(name, dtype):
    shapes = [(1,), (7,), (3, 1), (4, 7), (2, 3, 128), (1000,), (3, 5000)]
    run_grads([Case(name, dtype, shape, GRAD_CONFIGS["prenorm"]) for shape in shapes])


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_gradients_match_float64(name, dtype):
    """With a residual: dresidual is dx, and all gradients are those of the function
    the forward computes (which normalises the unrounded sum)."""
    cases = [Case(name, dtype, (2, 5, 300), c) for c in RESIDUAL_GRAD_CONFIGS.values()]
    shapes = [(1,), (3, 1), (4, 7), (3, 5000)]
    cases += [Case(name, dtype, s, RESIDUAL_GRAD_CONFIGS["residual_prenorm"]) for s in shapes]
    run_grads(cases)


def test_layer_norm_gradient_of_a_constant_row_with_residual():
    """bfloat16 256 + 1: the forward normalises the constant row 257 (xhat = 0), so
    dweight is 0 and dx = rstd * (g - mean(g)) with rstd = 1 / sqrt(eps)."""
    x = jnp.full((2, 64), 256.0, jnp.bfloat16)
    r = jnp.full((2, 64), 1.0, jnp.bfloat16)
    w, b = jnp.ones((64,), jnp.float32), jnp.zeros((64,), jnp.float32)
    g = np.tile(np.linspace(-1.0, 1.0, 64, dtype=np.float32) ** 3 + 0.25, (2, 1))

    def loss(x, r, w, b):
        y = quack_jax.layer_norm(x, w, b, residual=r, eps=1e-4, out_dtype=jnp.float32)
        return jnp.sum(y * g)

    y = quack_jax.layer_norm(x, w, b, residual=r, eps=1e-4, out_dtype=jnp.float32)
    np.testing.assert_array_equal(y, 0.0)
    dx, dr, dw, db = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, r, w, b)
    ref_dx = 100.0 * (g - g.mean(axis=-1, keepdims=True))
    assert_close(dx, ref_dx.astype(np.float64), "bfloat16")
    np.testing.assert_array_equal(dr, dx)
    np.testing.assert_allclose(dw, 0.0, atol=1e-6)
    np.testing.assert_allclose(db, g.sum(axis=0), rtol=1e-6)


# -- empty and float64 ----------------------------------------------------------------


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16)])
def test_empty_rows(name, shape):
    n = shape[-1]
    x, r = jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)
    w, b = jnp.ones((n,), jnp.float32), jnp.ones((n,), jnp.float32)
    if name == "rms_norm":
        b = None
    y, h = call(name, x, r, w, b, prenorm=True)
    assert y.shape == shape and h.shape == shape and y.dtype == jnp.bfloat16

    def loss(x, r, w, b):
        y, h = call(name, x, r, w, b, prenorm=True)
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h.astype(jnp.float32))

    dx, dr, dw, db = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, r, w, b)
    assert dx.shape == shape and dr.shape == shape and dx.dtype == jnp.bfloat16
    assert dw.shape == (n,) and dw.dtype == jnp.float32
    np.testing.assert_array_equal(dw, np.zeros(n))
    if b is not None:
        np.testing.assert_array_equal(db, np.zeros(n))


@pytest.mark.parametrize("name", OPS)
def test_float64_uses_reference(name):
    with jax.enable_x64(True):
        shape = (3, 50)
        x = jnp.asarray(3.0 * RNG.standard_normal(shape) + 1.0)
        r = jnp.asarray(RNG.standard_normal(shape))
        w = jnp.asarray(RNG.standard_normal(50))
        b = None if name == "rms_norm" else jnp.asarray(RNG.standard_normal(50))
        gy = np.asarray(RNG.standard_normal(shape))
        y, h = call(name, x, r, w, b, prenorm=True, eps=1e-3, weight_offset=1.0)
        assert y.dtype == jnp.float64 and h.dtype == jnp.float64
        np.testing.assert_array_equal(h, np.asarray(x) + np.asarray(r))
        rms = name == "rms_norm"
        ref = np_norm(np.asarray(h), w, b, rms=rms, eps=1e-3, offset=1.0)
        np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)

        def loss(x, w, b):
            return jnp.sum(call(name, x, None, w, b, eps=1e-3, weight_offset=1.0) * gy)

        dx, dw, db = jax.grad(loss, argnums=(0, 1, 2))(x, w, b)
        assert dx.dtype == jnp.float64 and dw.dtype == jnp.float64
        refs = np_grads(np.asarray(x), w, b, gy, None, rms=rms, eps=1e-3, offset=1.0)
        for grad, ref in zip((dx, dw, db), refs, strict=True):
            if ref is None:
                assert grad is None
            else:
                np.testing.assert_allclose(grad, ref, rtol=1e-10, atol=1e-10)


# -- transforms -----------------------------------------------------------------------


def assert_allclose32(a, b):
    """Two float32 results of the same computation, within float32 tolerance."""
    assert_close(a, f64(b), "float32")


@pytest.mark.parametrize("name", OPS)
def test_vmap_over_x_with_shared_weight(name):
    x, r, w, b = make_inputs(
        name, "float32", (4, 6, 96), weight="float32", bias="float32", residual=True
    )

    def fn(x, r):
        return call(name, x, r, w, b, prenorm=True, weight_offset=1.0)

    y, h = jax.vmap(fn)(x, r)
    loop = [fn(x[i], r[i]) for i in range(4)]
    assert_allclose32(y, jnp.stack([o[0] for o in loop]))
    np.testing.assert_array_equal(h, jnp.stack([o[1] for o in loop]))
    ref = np_norm(np_hn(x, r), w, b, rms=name == "rms_norm", eps=1e-6, offset=1.0)
    assert_close(y, ref, "float32")
    # a batch axis that is not the first
    y1 = jax.jit(jax.vmap(lambda x: call(name, x, None, w, b), in_axes=1, out_axes=1))(x)
    assert_close(y1, np_norm(x, w, b, rms=name == "rms_norm", eps=1e-6, offset=0.0), "float32")


@pytest.mark.parametrize("name", OPS)
def test_vmap_over_x_and_weight(name):
    x = random((4, 6, 96), "float32", 3.0, 1.0)
    w = random((4, 96), "float32", 1.0, 0.5)
    b = random((4, 96), "float32") if name == "layer_norm" else None
    in_axes = (0, 0, None if b is None else 0)
    y = jax.jit(jax.vmap(lambda x, w, b: call(name, x, None, w, b), in_axes=in_axes))(x, w, b)
    for i in range(4):
        bi = None if b is None else b[i]
        ref = np_norm(x[i], w[i], bi, rms=name == "rms_norm", eps=1e-6, offset=0.0)
        assert_close(y[i], ref, "float32")
        assert_allclose32(y[i], call(name, x[i], None, w[i], bi))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("weights_batched", [False, True])
def test_vmap_of_grad_gives_per_example_grads(name, weights_batched):
    batch, shape, n = 3, (5, 64), 64
    x = random((batch, *shape), "float32", 3.0, 1.0)
    g = random((batch, *shape), "float32")
    w = random((batch, n) if weights_batched else (n,), "float32", 1.0, 0.5)
    b = random(w.shape, "float32")
    if name == "rms_norm":
        b = None

    def loss(x, w, b, g):
        return jnp.sum(call(name, x, None, w, b, weight_offset=0.5) * g)

    vector_axis = 0 if weights_batched else None
    in_axes = (0, vector_axis, None if b is None else vector_axis, 0)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=in_axes))(x, w, b, g)
    for i in range(batch):
        wi = w[i] if weights_batched else w
        bi = None if b is None else b[i] if weights_batched else b
        loop = jax.grad(loss, argnums=(0, 1, 2))(x[i], wi, bi, g[i])
        refs = np_grads(x[i], wi, bi, g[i], None, rms=name == "rms_norm", eps=1e-6, offset=0.5)
        for grad, one, ref in zip(grads, loop, refs, strict=True):
            if ref is None:
                assert grad is None and one is None
                continue
            assert_allclose32(grad[i], one)
            assert_close(grad[i], ref, "float32")


@pytest.mark.parametrize("name", OPS)
def test_grad_of_vmapped_norm(name):
    x = random((4, 6, 96), "float32", 3.0, 1.0)
    r = random((4, 6, 96), "float32")
    g = random((4, 6, 96), "float32")
    w = random((96,), "float32", 1.0, 0.5)
    b = random((96,), "float32") if name == "layer_norm" else None

    def loss(x, r, w, b):
        y = jax.vmap(lambda x, r: call(name, x, r, w, b), in_axes=(0, 0))(x, r)
        return jnp.sum(y * g)

    dx, dr, dw, db = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, r, w, b)
    refs = np_grads(np_hn(x, r), w, b, g, None, rms=name == "rms_norm", eps=1e-6, offset=0.0)
    assert_close(dx, refs[0], "float32")
    np.testing.assert_array_equal(np.asarray(dr), np.asarray(dx))
    assert_close(dw, refs[1], "float32")
    if b is not None:
        assert_close(db, refs[2], "float32")


@pytest.mark.parametrize("name", OPS)
def test_jit_matches_eager_and_checkpoint(name):
    x, r, w, b = make_inputs(
        name, "bfloat16", (2, 3, 200), weight="bfloat16", bias="bfloat16", residual=True
    )
    eager = call(name, x, r, w, b)
    np.testing.assert_array_equal(jax.jit(lambda x: call(name, x, r, w, b))(x), eager)
    assert_close(
        eager, np_norm(np_hn(x, r), w, b, rms=name == "rms_norm", eps=1e-6, offset=0.0), "bfloat16"
    )

    def loss(x, w):
        return jnp.sum(jnp.sin(call(name, x, None, w, b).astype(jnp.float32)))

    plain = jax.grad(loss, argnums=(0, 1))(x, w)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(x, w)
    for a, c in zip(plain, remat, strict=True):
        assert a.dtype == c.dtype == jnp.bfloat16
        assert_close(c, f64(a), "bfloat16")


# -- bad input ------------------------------------------------------------------------

X = jnp.ones((4, 8), jnp.bfloat16)
BAD = [
    (dict(weight=jnp.ones((7,), jnp.bfloat16)), ValueError, "weight must have shape (8,)"),
    (dict(weight=jnp.ones((4, 8), jnp.bfloat16)), ValueError, "weight must have shape (8,)"),
    (dict(weight=jnp.ones((8,), jnp.int32)), TypeError, "weight must have a floating dtype"),
    (dict(weight=jnp.ones((8,), jnp.float16)), TypeError, "weight must be float32 or x's dtype"),
    (dict(weight=[1.0] * 8), TypeError, "weight must be an array"),
    (dict(residual=jnp.ones((4, 7), jnp.bfloat16)), ValueError, "residual must have x's shape"),
    (dict(residual=jnp.ones((8,), jnp.bfloat16)), ValueError, "residual must have x's shape"),
    (dict(residual=jnp.ones((4, 8), jnp.float32)), TypeError, "residual must have x's dtype"),
    (dict(eps=0.0), ValueError, "eps must be positive and finite"),
    (dict(eps=-1e-5), ValueError, "eps must be positive and finite"),
    (dict(eps=float("nan")), ValueError, "eps must be positive and finite"),
    (dict(eps=float("inf")), ValueError, "eps must be positive and finite"),
    (dict(eps=jnp.float32(1e-5)), TypeError, "eps must be a Python float"),
    (dict(eps=True), TypeError, "eps must be a Python float"),
    (dict(eps="1e-5"), TypeError, "eps must be a Python float"),
    (dict(weight_offset=1.0), ValueError, "weight_offset=1.0 needs a weight"),
    (dict(weight=X[0], weight_offset=float("nan")), ValueError, "weight_offset must be finite"),
    (dict(weight=X[0], weight_offset=jnp.float32(1.0)), TypeError, "weight_offset must be a"),
    (dict(prenorm=1), TypeError, "prenorm must be a bool"),
    (dict(prenorm=jnp.bool_(True)), TypeError, "prenorm must be a bool"),
    (dict(out_dtype=jnp.int32), TypeError, "out_dtype must be float32, bfloat16"),
    (dict(out_dtype="complex64"), TypeError, "out_dtype must be float32, bfloat16"),
    (dict(out_dtype="not a dtype"), TypeError, "out_dtype must be a dtype"),
]
BAD_LAYER_NORM = [
    (dict(bias=jnp.ones((9,), jnp.bfloat16)), ValueError, "bias must have shape (8,)"),
    (dict(bias=jnp.ones((8,), jnp.float16)), TypeError, "bias must be float32 or x's dtype"),
    (dict(bias=jnp.ones((8,), jnp.int8)), TypeError, "bias must have a floating dtype"),
]
BAD_X = [
    (jnp.ones((4, 8), jnp.int32), TypeError, "x must have a floating dtype"),
    (np.ones((4, 8), np.int64), TypeError, "x must have a floating dtype"),
    (jnp.ones((4, 8), bool), TypeError, "x must have a floating dtype"),
    (jnp.float32(1.0), ValueError, "x must have at least one dimension"),
    ([[1.0, 2.0]], TypeError, "x must be an array"),
]


def expect(name, error, message):
    return pytest.raises(error, match=re.escape(f"{name}: {message}"))


def traced(name, kwargs):
    """The call under jit, with the array arguments traced."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    return jax.jit(lambda x, arrays: OPS[name](x, **arrays, **static))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize(("kwargs", "error", "message"), BAD + BAD_LAYER_NORM)
def test_bad_argument(name, kwargs, error, message):
    if name == "rms_norm" and "bias" in kwargs:
        with pytest.raises(TypeError, match="bias"):
            OPS[name](X, **kwargs)
        return
    with expect(name, error, message):
        OPS[name](X, **kwargs)
    if all(not isinstance(v, list) for v in kwargs.values()):
        fn = traced(name, kwargs)
        with expect(name, error, message):
            fn(X, {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)})


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize(("x", "error", "message"), BAD_X)
def test_bad_x(name, x, error, message):
    with expect(name, error, message):
        OPS[name](x)
    if isinstance(x, jax.Array):
        with expect(name, error, message):
            jax.jit(OPS[name])(x)


@pytest.mark.parametrize("name", OPS)
def test_traced_eps_and_offset_are_rejected(name):
    with expect(name, TypeError, "eps must be a Python float"):
        jax.jit(lambda x, eps: OPS[name](x, eps=eps))(X, 1e-5)
    with expect(name, TypeError, "weight_offset must be a Python float"):
        jax.jit(lambda x, o: OPS[name](x, X[0], weight_offset=o))(X, 1.0)
    with expect(name, TypeError, "prenorm must be a bool"):
        jax.jit(lambda x, p: OPS[name](x, prenorm=p))(X, True)


def test_accepted_argument_forms():
    """numpy inputs, numpy scalars for eps, a float32 weight with bfloat16 x, dtype names."""
    x = np.asarray(RNG.standard_normal((3, 8)), np.float32)
    w = np.asarray(RNG.standard_normal(8), np.float32)
    y = quack_jax.rms_norm(x, w, eps=np.float32(0.25), out_dtype="bfloat16")
    assert y.dtype == jnp.bfloat16
    assert_close(y, np_norm(x, w, None, rms=True, eps=0.25, offset=0.0), "bfloat16")
    y = quack_jax.layer_norm(jnp.asarray(x, jnp.bfloat16), w, w, eps=1)
    assert y.dtype == jnp.bfloat16


# -- sharding on 8 host devices -------------------------------------------------------


def mesh():
    return Mesh(np.asarray(jax.devices("cpu")[:8]), ("data",))


@pytest.mark.parametrize("name", OPS)
def test_sharded_jit_matches_unsharded(name):
    x, _, w, b = make_inputs(name, "float32", (64, 300), weight="float32", bias="float32")
    g = random(x.shape, "float32")
    rows = NamedSharding(mesh(), PartitionSpec("data", None))
    replicated = NamedSharding(mesh(), PartitionSpec())
    xs = jax.device_put(x, rows)
    ws = jax.device_put(w, replicated)
    bs = None if b is None else jax.device_put(b, replicated)

    def forward(x, w, b):
        return call(name, x, None, w, b, weight_offset=1.0)

    def loss(x, w, b):
        return jnp.sum(forward(x, w, b) * g)

    y = jax.jit(forward)(xs, ws, bs)
    assert y.sharding.spec[0] == "data"
    assert_allclose32(y, forward(x, w, b))
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(xs, ws, bs)
    ref_value, plain_grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, b)
    terms = float(jnp.sum(jnp.abs(forward(x, w, b) * g)))  # the sum cancels
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6 * terms)
    assert grads[0].sharding.spec[0] == "data"
    for grad, ref in zip(grads, plain_grads, strict=True):
        if ref is None:
            assert grad is None
        else:
            assert_allclose32(grad, ref)
    refs = np_grads(x, w, b, g, None, rms=name == "rms_norm", eps=1e-6, offset=1.0)
    assert_close(grads[0], refs[0], "float32")
    assert_close(grads[1], refs[1], "float32")


def row_sharded_norm(name, check_vma=True):
    """``name`` with residual and prenorm under jax.shard_map over rows of x and the
    residual, weight and bias replicated."""
    spec, rep = PartitionSpec("data", None), PartitionSpec()

    def forward(x, r, w, b):
        return call(name, x, r, w, b, prenorm=True, weight_offset=0.5)

    b_spec = None if name == "rms_norm" else rep
    mapped = jax.shard_map(
        forward,
        mesh=mesh(),
        in_specs=(spec, spec, rep, b_spec),
        out_specs=(spec, spec),
        check_vma=check_vma,
    )
    return forward, mapped, NamedSharding(mesh(), spec)


@pytest.mark.parametrize("name", OPS)
def test_shard_map_matches_unsharded(name):
    x, r, w, b = make_inputs(
        name, "bfloat16", (64, 300), weight="bfloat16", bias="float32", residual=True
    )
    forward, mapped, rows = row_sharded_norm(name)
    y, h = jax.jit(mapped)(jax.device_put(x, rows), jax.device_put(r, rows), w, b)
    assert y.sharding.spec[0] == "data"
    ref_y, ref_h = forward(x, r, w, b)
    np.testing.assert_array_equal(h, ref_h)
    np.testing.assert_array_equal(h, np_h(x, r))
    assert_close(y, f64(ref_y), "bfloat16")
    ref = np_norm(np_hn(x, r), w, b, rms=name == "rms_norm", eps=1e-6, offset=0.5)
    assert_close(y, ref, "bfloat16")


@pytest.mark.parametrize("name", OPS)
def test_grad_through_shard_map_matches_unsharded(name):
    x, r, w, b = make_inputs(
        name, "float32", (64, 300), weight="float32", bias="float32", residual=True
    )
    gy, gh = random(x.shape, "float32"), random(x.shape, "float32")
    forward, mapped, rows = row_sharded_norm(name)

    def loss(fn):
        def value(x, r, w, b):
            y, h = fn(x, r, w, b)
            return jnp.sum(y * gy) + jnp.sum(h * gh)

        return value

    argnums = (0, 1, 2) if b is None else (0, 1, 2, 3)
    xs, rs = jax.device_put(x, rows), jax.device_put(r, rows)
    grads = jax.jit(jax.grad(loss(mapped), argnums=argnums))(xs, rs, w, b)
    plain = jax.grad(loss(forward), argnums=argnums)(x, r, w, b)
    refs = np_grads(np_hn(x, r), w, b, gy, gh, rms=name == "rms_norm", eps=1e-6, offset=0.5)
    np.testing.assert_array_equal(grads[1], grads[0])
    assert grads[0].sharding.spec[0] == "data"
    expected = [refs[0], refs[0], *refs[1 : len(grads) - 1]]
    for grad, one, ref in zip(grads, plain, expected, strict=True):
        assert grad.dtype == one.dtype == jnp.float32
        assert_close(grad, f64(one), "float32")
        assert_close(grad, ref, "float32")


# -- CUDA lowering (kernels compiled with CuTe-DSL, no GPU needed) --------------------


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def cuda(kernel_dir, monkeypatch):
    """Lower for sm_90a, compiling into a cache shared by this module's tests."""
    monkeypatch.setenv("QUACK_JAX_CACHE", str(kernel_dir))
    monkeypatch.setenv("QUACK_JAX_CUDA_ARCH", "sm_90a")
    monkeypatch.setattr(_cache, "_memory", {})


def lowered(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def launches(text):
    return text.count(f"custom_call @{_ffi.TARGET}")


@pytest.mark.cutlass
@pytest.mark.parametrize("name", OPS)
def test_cuda_lowering_launches_forward_and_backward_kernels(cuda, name):
    x = jnp.zeros((4, 7, 1000), jnp.bfloat16)
    w = jnp.zeros((1000,), jnp.bfloat16)
    b = jnp.zeros((1000,), jnp.bfloat16) if name == "layer_norm" else None

    def forward(x, w, b):
        return call(name, x, None, w, b)

    text = lowered(forward, x, w, b)
    assert launches(text) == 1
    assert {k[0] for k in _cache._memory} == {f"{name}_fwd"}

    def loss(x, w, b):
        return jnp.sum(forward(x, w, b).astype(jnp.float32) ** 2)

    text = lowered(jax.grad(loss, argnums=(0, 1, 2) if b is not None else (0, 1)), x, w, b)
    assert launches(text) == 2
    assert {k[0] for k in _cache._memory} == {f"{name}_fwd", f"{name}_bwd"}


LOWERING_CONFIGS = {
    "residual": dict(residual=True),
    "weight_f32": dict(weight="float32"),
    "bias": dict(weight="bfloat16", bias="bfloat16"),
    "out_f32": dict(out_dtype="float32"),
    "prenorm": dict(residual=True, prenorm=True, weight="float32"),
    "prenorm_offset": dict(prenorm=True, weight="bfloat16", weight_offset=1.0),
    "all": dict(residual=True, prenorm=True, weight="float32", bias="float32", out_dtype="float32"),
}


@pytest.mark.parametrize(
    ("name", "config"),
    [(n, c) for n in OPS for c in LOWERING_CONFIGS if n == "layer_norm" or c != "bias"],
)
@pytest.mark.cutlass
def test_cuda_lowering_flag_combinations(cuda, name, config):
    config = dict(LOWERING_CONFIGS[config])
    x, r, w, b = make_inputs(
        name,
        "bfloat16",
        (3, 5, 512),
        weight=config.pop("weight", None),
        bias=config.pop("bias", None),
        residual=config.pop("residual", False),
    )
    prenorm = config.get("prenorm", False)

    def forward(x, r, w, b):
        return call(name, x, r, w, b, **config)

    def loss(x, r, w, b):
        out = forward(x, r, w, b)
        y, h = out if prenorm else (out, x)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(h.astype(jnp.float32))

    assert launches(lowered(forward, x, r, w, b)) == 1
    argnums = tuple(i for i, a in enumerate((x, r, w, b)) if a is not None)
    assert launches(lowered(jax.grad(loss, argnums=argnums), x, r, w, b)) == 2
    # no kernel for empty rows, nor for float64
    empty = [None if a is None else jnp.zeros((0, *a.shape[1:]), a.dtype) for a in (x, r)]
    assert launches(lowered(forward, *empty, w, b)) == 0
    assert launches(lowered(jax.grad(loss, argnums=argnums), *empty, w, b)) == 0
    with jax.enable_x64(True):
        as64 = [None if a is None else a.astype(jnp.float64) for a in (x, r, w, b)]
        assert launches(lowered(forward, *as64)) == 0
        assert launches(lowered(jax.grad(loss, argnums=argnums), *as64)) == 0
