"""rms_norm and layer_norm on both backends against one float64 reference: values and
gradients (of x, the residual, weight and bias) over the SPEC's grid and for every mix of
operands and options (weight and bias dtypes, residual, prenorm, weight_offset, eps,
out_dtype), leading axes, special values, where eps and the residual's rounding go,
forward mode (jvp, jacfwd, vmap of jvp, Hessian-vector products), vmap with a batched
weight, out_dtype float64 without x64, accepted argument forms; on the CPU also the
reference's gradients against autodiff and the CUDA lowering (kernels compiled with
CuTe-DSL, no GPU needed). What every op has (jit, vmap, checkpoint, scan, float64, no
rows and one row, bad arguments) is tested in ``test_contract.py``, sharding in
``test_sharding.py``.

The weight and bias gradients must be the same on every run. The gpu tests run the
operand mixes at the row lengths whose kernels the family's SPEC builds
(``quack_jax.norm.spec``: its named mixes at every test length, every operand mix at
``MIX_SIZES``).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import BACKENDS, assert_close, backend_param, backends, grid, key_for, run

import quack_jax
from quack_jax import _cache, _ffi, _primitive
from quack_jax._registry import specs as op_specs
from quack_jax.norm import backward as norm_backward
from quack_jax.norm import spec as norm_spec
from quack_jax.norm.spec import MIXES, Mix, forward, forward_backward, structs

OPS = {"rms_norm": quack_jax.rms_norm, "layer_norm": quack_jax.layer_norm}
EPS = 1e-5
# row lengths at which every named mix is tested, in rows of MIX_ROWS
MIX_SIZES = {"cpu": (257,), "gpu": norm_spec.MIX_SIZES}
MIX_ROWS = {"cpu": 3, "gpu": 1000}
SDS = jax.ShapeDtypeStruct


# -- the float64 reference ---------------------------------------------------------------


def reference(op, h, w=None, b=None, dy=None, dh=None, *, eps, offset=0.0):
    """float64 results of ``op`` at h (x, or x + residual rounded to x's dtype), each with
    the magnitude of the terms that make it (what its error is judged against): a dict of
    "y" and, given the cotangents dy (of y) and dh (of h, or None), "dx" (also the
    residual's gradient), "dweight" and "dbias" (None without the operand) -> (value,
    magnitude); and "xhat", "rstd" and "terms" (the size of xhat's terms). In numpy, or
    in jax.numpy on h's device where h is a jax Array (the GPU tests' large rows)."""
    xp = jnp if isinstance(h, jax.Array) else np
    with jax.enable_x64(True), np.errstate(all="ignore"):
        h, w, b, dy, dh = (
            None if a is None else xp.asarray(a).astype(xp.float64) for a in (h, w, b, dy, dh)
        )
        mean = 0.0 if op == "rms_norm" else h.mean(axis=-1, keepdims=True)
        rstd = 1.0 / xp.sqrt(((h - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
        xhat = (h - mean) * rstd
        terms = (xp.abs(h) + xp.abs(mean)) * rstd  # the size of xhat's terms
        scale = 1.0 if w is None else w + offset
        y = xhat * scale + (0.0 if b is None else b)
        y_mag = terms * xp.abs(scale) + (0.0 if b is None else xp.abs(b))
        out = {"y": (y, y_mag), "xhat": xhat, "rstd": rstd, "terms": terms}
        if dy is None:
            return out
        g = dy * scale
        dx = g - xhat * (g * xhat).mean(axis=-1, keepdims=True)
        dx_mag = xp.abs(g) + terms * (xp.abs(g) * terms).mean(axis=-1, keepdims=True)
        if op == "layer_norm":
            dx = dx - g.mean(axis=-1, keepdims=True)
            dx_mag = dx_mag + xp.abs(g).mean(axis=-1, keepdims=True)
        dx, dx_mag = dx * rstd, dx_mag * rstd
        if dh is not None:
            dx, dx_mag = dx + dh, dx_mag + xp.abs(dh)
        axes = tuple(range(h.ndim - 1))
        out["dx"] = dx, dx_mag
        dw = (dy * xhat).sum(axis=axes), (xp.abs(dy) * terms).sum(axis=axes)
        out["dweight"] = None if w is None else dw
        out["dbias"] = None if b is None else (dy.sum(axis=axes), xp.abs(dy).sum(axis=axes))
        return out


def np_h(x, residual):
    """The h returned with prenorm: x, or x + residual rounded to x's dtype (numpy)."""
    x = np.asarray(x)
    if residual is None:
        return x
    wide = np.result_type(x.dtype, np.float32)
    return (x.astype(wide) + np.asarray(residual).astype(wide)).astype(x.dtype)


def np_stats(h, rms, eps):
    """The reference's float64 xhat and rstd (over the last axis, kept) of h (numpy)."""
    ref = reference("rms_norm" if rms else "layer_norm", np.asarray(h), eps=eps)
    return ref["xhat"], ref["rstd"]


def np_norm(h, weight, bias, *, rms, eps, offset):
    """The reference's float64 y (numpy)."""
    op = "rms_norm" if rms else "layer_norm"
    return reference(op, np.asarray(h), weight, bias, eps=eps, offset=offset)["y"][0]


def jnp_norm(rms, eps, offset):
    """y of (h, weight, bias) in plain jnp, for float64 autodiff."""

    def fn(h, w, b):
        centred = h if rms else h - jnp.mean(h, axis=-1, keepdims=True)
        y = centred / jnp.sqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
        if w is not None:
            y = y * (w + offset)
        if b is not None:
            y = y + b
        return y

    return fn


def f64(*arrays):
    """The arrays as float64 jax arrays (None stays None); inside ``jax.enable_x64``."""
    return [None if a is None else jnp.asarray(np.asarray(a, np.float64)) for a in arrays]


def jax64_grads(h, weight, bias, dy, dh, *, rms, eps, offset):
    """Float64 (dx, dweight, dbias) by jax.vjp of a float64 jnp implementation, for
    cotangents dy of y and dh of h (or None): the check of the reference's gradients."""
    with jax.enable_x64(True):
        f64s = f64(h, weight, bias, dy, dh)
        _, vjp = jax.vjp(jnp_norm(rms, eps, offset), *f64s[:3])
        dx, dw, db = vjp(f64s[3])
        if dh is not None:
            dx = dx + f64s[4]
        return [None if g is None else np.asarray(g) for g in (dx, dw, db)]


# -- the calls under test -----------------------------------------------------------------


def norm(op, x, w=None, b=None, r=None, **kwargs):
    """``op`` of x with weight w, bias b (layer_norm only) and residual r."""
    params = (w,) if op == "rms_norm" else (w, b)
    return OPS[op](x, *params, residual=r, **kwargs)


def operands(backend, op, shape, dtype, mix, key):
    """Random (x, weight, bias, residual, dy, dh): x with a mean offset (it matters to
    LayerNorm), the weight about 1; the cotangents in y's and h's dtypes. Drawn by numpy
    for the CPU (no compiles), on the device for the GPU (large arrays)."""
    scale_shift = ((2.0, 0.5), (0.2, 1.0), (0.5, 0.0), (1.0, 0.0), (1.0, 0.0), (1.0, 0.0))
    if backend == "cpu":
        rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
        normals = [functools.partial(rng.standard_normal, dtype=np.float32)] * 6
    else:
        normals = [functools.partial(jax.random.normal, k) for k in jax.random.split(key, 6)]
    return [
        None if s is None else jnp.asarray((shift + scale * normal(s.shape)).astype(s.dtype))
        for s, normal, (scale, shift) in zip(
            structs(op, shape, dtype, mix), normals, scale_shift, strict=True
        )
    ]


def rows_h(backend, x, r):
    """h for the reference: numpy on the CPU; on the GPU on the device (rounded on the
    host: XLA would drop a narrowing convert that is widened again)."""
    if backend == "cpu":
        return np_h(x, r)
    return x if r is None else jnp.asarray(np_h(x, r))


def check(backend, op, mix, args, out, grads, what):
    """The outputs and gradients of ``forward_backward`` against the reference."""
    x, w, b, r, dy, dh = args
    dtype = x.dtype.name
    y, h = out if mix.prenorm else (out, None)
    dx, dw, db, dr = grads
    h_ref = rows_h(backend, x, r)
    ref = reference(op, h_ref, w, b, dy, dh, eps=mix.eps, offset=mix.offset)
    out_dtype = mix.dtypes(op, dtype)[2]
    assert y.shape == dx.shape == x.shape, what
    assert y.dtype == out_dtype and dx.dtype == x.dtype, what
    assert_close(y, *ref["y"], out_dtype, f"y {what}", x=x)
    if mix.prenorm:
        assert h.shape == x.shape and h.dtype == x.dtype, what
        assert_close(h, h_ref, 0.0, dtype, f"h {what}")  # equal, but for subnormals
    assert_close(dx, *ref["dx"], dtype, f"dx {what}", x=x, dy=dy)
    for grad, operand, name in ((dw, w, "dweight"), (db, b, "dbias")):
        if operand is None:
            assert grad is None, what
        else:
            assert grad.shape == operand.shape and grad.dtype == operand.dtype, what
            assert_close(grad, *ref[name], operand.dtype.name, f"{name} {what}")
    if r is None:
        assert dr is None, what
    else:
        assert np.asarray(dr).tobytes() == np.asarray(dx).tobytes(), f"dresidual != dx: {what}"


def assert_same_bits(a, b, what):
    for one, two in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(one).tobytes() == np.asarray(two).tobytes(), what


def run_cases(backend, cases):
    """``forward_backward`` of each (op, mix name, operands) in one compiled function,
    checked against the reference; the weight and bias gradients again on a second run,
    bit for bit."""
    fns = [forward_backward(op, MIXES[name]) for op, name, _ in cases]
    args = [a for _, _, a in cases]

    def every(args):
        return [fn(*a) for fn, a in zip(fns, args, strict=True)]

    results = run(backend, every, args, launches=2 * len(cases))
    for (op, name, a), (out, grads) in zip(cases, results, strict=True):
        shape = "x".join(map(str, a[0].shape))
        check(backend, op, MIXES[name], a, out, grads, f"{op} {name} {shape} {a[0].dtype}")
    again = run(backend, every, args, launches=2 * len(cases))
    weight_grads = [[grads[1:3] for _, grads in outs] for outs in (results, again)]
    assert_same_bits(*weight_grads, "the weight gradients differ between runs")


# -- values and gradients -------------------------------------------------------------------


def grid_cases():
    """(backend, m, n, dtype, rms_norm's mix, layer_norm's mix): the SPEC's grid on each
    backend, the mixes in turn."""
    names = list(MIXES)
    return [
        backend_param(*p.values, names[i % len(names)], names[(i + 3) % len(names)])
        for i, p in enumerate(grid("rms_norm"))
    ]


@pytest.mark.parametrize(("backend", "m", "n", "dtype", "rms_mix", "layer_mix"), grid_cases())
def test_forward_backward(backend, m, n, dtype, rms_mix, layer_mix):
    cases = [
        (op, mix, operands(backend, op, (m, n), dtype, MIXES[mix], key_for(op, m, n, dtype, mix)))
        for op, mix in zip(OPS, (rms_mix, layer_mix), strict=True)
    ]
    run_cases(backend, cases)


# row lengths whose bfloat16 backward takes one row a CTA, without a cluster of its own
ONE_ROW_A_CTA = {"rms_norm": 8192, "layer_norm": 4096}


def cuda_text(fn, *args):
    """``fn`` lowered for CUDA, as StableHLO text."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def cluster_dims(text):
    """The cluster shape of each kernel launched in lowered ``text``."""
    return [d.split(">", 1)[0] for d in text.split("cluster = dense<")[1:]]


def summing_cases(ctas, blocks):
    """(op, mix name, shape, dtype, whether the backward must be one cluster of ``ctas``)
    for the test below."""
    mixes = ("weight_residual_prenorm", "fp32_params_offset")
    for m, n, dtype in ((ctas * blocks, None, "bfloat16"), (ctas * blocks - 1, 1000, "float32")):
        for op, mix in zip(OPS, mixes, strict=True):
            yield op, mix, (m, n or ONE_ROW_A_CTA[op]), dtype, n is None


SUMMING_CLUSTERS = [(2, 1), (8, 1), (8, 4), (16, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize(("ctas", "blocks"), SUMMING_CLUSTERS)
def test_weight_gradients_summed_in_one_cluster(monkeypatch, ctas, blocks):
    """The backward on a grid of one cluster that sums its weight-gradient partials
    itself, for clusters of 2 to 16 CTAs and up to 4 row blocks a CTA, with LayerNorm's
    bias gradient beside the weight's: values, gradients and the same bits again."""
    monkeypatch.setattr(norm_backward, "SUM_CLUSTER_CTAS", ctas)
    monkeypatch.setattr(norm_backward, "SUM_CLUSTER_BLOCKS", blocks)
    cases = []
    for op, mix, shape, dtype, one_cluster in summing_cases(ctas, blocks):
        args = operands("gpu", op, shape, dtype, MIXES[mix], key_for(op, shape, ctas, blocks))
        cases.append((op, mix, args))
        backward = cluster_dims(cuda_text(forward_backward(op, MIXES[mix]), *args))[-1]
        if one_cluster:
            assert backward == f"[{ctas}, 1, 1]", (op, shape, backward)
    run_cases("gpu", cases)


def mix_sizes():
    return [
        backend_param(backend, n, dtype)
        for backend in BACKENDS
        for n in MIX_SIZES[backend]
        for dtype in op_specs()["rms_norm"].tests[backend].dtypes
    ]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("backend", "n", "dtype"), mix_sizes())
def test_every_mix(backend, n, dtype, op):
    """Every mix of operands and options."""
    m = MIX_ROWS[backend]
    run_cases(
        backend,
        [
            (op, name, operands(backend, op, (m, n), dtype, mix, key_for(op, n, dtype, name)))
            for name, mix in MIXES.items()
        ],
    )


# shapes of rank 1 and 3 and rows of one, the dtype and mix of each
LEADING = (
    ((1,), "float32", "all"),
    ((7,), "bfloat16", "mixed_params_prenorm_bf16_out"),
    ((1000,), "float16", "weight_residual_prenorm"),
    ((4, 1), "bfloat16", "residual_fp32_out"),
    ((2, 3, 128), "float16", "all"),
    ((2, 5, 1000), "float32", "bias_residual_eps"),
    ((2, 1, 5120), "bfloat16", "weight_residual_prenorm"),
)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backends())
def test_leading_axes(backend, op):
    """Ranks 1 and 3 and rows of one."""
    run_cases(
        backend,
        [
            (op, name, operands(backend, op, shape, dtype, MIXES[name], key_for(op, shape, dtype)))
            for shape, dtype, name in LEADING
        ],
    )


SPECIAL_MIX = "fp32_params_offset"


@pytest.mark.parametrize(("backend", "n", "dtype"), grid("rms_norm", special=True))
def test_special_values(backend, n, dtype):
    """NaN, +-inf and large values propagate as in the float64 reference."""
    big = 6e4 if dtype == "float16" else 1e4
    cases = []
    for op in OPS:
        args = operands(backend, op, (8, n), dtype, MIXES[SPECIAL_MIX], key_for(op, n, dtype))
        x = np.array(args[0], np.float32)
        x[0, n // 2] = np.nan
        x[1, n // 3] = np.inf
        x[2, :] = -np.inf
        x[3, ::2] = big
        x[4, :] = big
        x[5, n - 1] = -big
        args[0] = jnp.asarray(x.astype(jnp.dtype(dtype)))
        cases.append((op, SPECIAL_MIX, args))
    run_cases(backend, cases)


def eps_norms(x, w):
    return (
        quack_jax.rms_norm(x, eps=5.0),
        quack_jax.layer_norm(x, eps=5.0),
        quack_jax.rms_norm(x, w, eps=5.0, weight_offset=1.0),
    )


@pytest.mark.parametrize("backend", backends())
def test_eps_is_added_inside_the_root(backend):
    """A constant row: y = (h - mean) * rsqrt(var + eps) exposes where eps goes."""
    x, w = jnp.full((2, 7), 2.0, jnp.float32), jnp.full((7,), 3.0, jnp.float32)
    rms, layer, scaled = run(backend, eps_norms, x, w, launches=3)
    assert_close(rms, np.full((2, 7), 2 / 3), 2 / 3, "float32", "rms_norm")
    np.testing.assert_array_equal(layer, 0.0)
    assert_close(scaled, np.full((2, 7), 8 / 3), 8 / 3, "float32", "rms_norm with a weight")


def rounded_residual(x, r):
    return quack_jax.rms_norm(x, residual=r, prenorm=True, out_dtype=jnp.float32)


@pytest.mark.parametrize("backend", backends())
def test_residual_sum_is_rounded_before_normalising(backend):
    """bfloat16: 256 + 1 rounds to 256, in the h returned and in the h normalised, as
    an unfused ``x + residual`` in bfloat16 would."""
    x = jnp.asarray([[256.0, -256.0] + [0.0] * 5], jnp.bfloat16)
    r = jnp.asarray([[1.0] + [0.0] * 6], jnp.bfloat16)
    y, h = run(backend, rounded_residual, x, r, launches=1)
    np.testing.assert_array_equal(np.asarray(h, np.float32), [[256.0, -256.0] + [0.0] * 5])
    rms = np.sqrt((256.0**2 + 256.0**2) / 7)
    ref = np.asarray([[256.0 / rms, -256.0 / rms] + [0.0] * 5])
    assert_close(y, ref, np.abs(ref), "float32", "y")


def constant_row(x, r, w, b, g):
    def f(x, r, w, b):
        return quack_jax.layer_norm(x, w, b, residual=r, eps=1e-4, out_dtype=jnp.float32)

    y, vjp = jax.vjp(f, x, r, w, b)
    return y, vjp(g)


@pytest.mark.parametrize("backend", backends())
def test_layer_norm_gradient_of_a_constant_row_with_residual(backend):
    """bfloat16 256 + 1 rounds to the constant row 256 (xhat = 0), so y and dweight are
    0 and dx = rstd * (g - mean(g)) with rstd = 1 / sqrt(eps)."""
    x = jnp.full((2, 1000), 256.0, jnp.bfloat16)
    r = jnp.full((2, 1000), 1.0, jnp.bfloat16)
    w, b = jnp.ones((1000,), jnp.float32), jnp.zeros((1000,), jnp.float32)
    g = np.tile(np.linspace(-1.0, 1.0, 1000, dtype=np.float32) ** 3 + 0.25, (2, 1))
    y, (dx, dr, dw, db) = run(backend, constant_row, x, r, w, b, g, launches=2)
    np.testing.assert_array_equal(y, 0.0)
    g64 = g.astype(np.float64)
    mag = 100.0 * (np.abs(g64) + np.abs(g64).mean(axis=-1, keepdims=True))
    assert_close(dx, 100.0 * (g64 - g64.mean(axis=-1, keepdims=True)), mag, "bfloat16", "dx")
    np.testing.assert_array_equal(dr, dx)
    np.testing.assert_array_equal(dw, 0.0)
    assert_close(db, g64.sum(axis=0), np.abs(g64).sum(axis=0), "float32", "dbias")


# -- out_dtype float64 without x64 -------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backends())
def test_float64_out_dtype_without_x64(backend, op):
    """out_dtype=float64 with x64 off is float32, as JAX takes a requested dtype: with
    JAX's warning, the values and gradients of out_dtype=float32, on both implementations."""
    mix = MIXES["all"]
    message = f"dtype float64 requested in {op} is not available"
    shape = (MIX_ROWS[backend], MIX_SIZES[backend][0])  # the float32 kernels of test_every_mix
    with jax.enable_x64(False):
        args = operands(backend, op, shape, "float32", mix, key_for("float64 out", op))
        want = run(backend, forward_backward(op, mix), *args, launches=2)
        f64 = forward_backward(op, dataclasses.replace(mix, out="float64"))
        with pytest.warns(UserWarning, match=message):
            got = run(backend, f64, *args, launches=2)
        assert got[0][0].dtype == jnp.float32
        assert_same_bits(got, want, f"{op}: out_dtype float64 differs from float32")
        x, w, b, r = args[:4]
        options = dict(eps=mix.eps, weight_offset=mix.offset, implementation="xla")
        with pytest.warns(UserWarning, match=message):
            y = norm(op, x, w, b, r, out_dtype=jnp.float64, **options)
        assert y.dtype == jnp.float32
        assert_same_bits(y, norm(op, x, w, b, r, out_dtype=jnp.float32, **options), op)


# -- transforms -------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backends())
def test_vmap_over_x_and_weight(backend, op):
    """A batched weight (and bias): the XLA reference, vmapped, on both backends."""
    mix = MIXES["fp32_params_offset"]
    args = operands(backend, op, (4, 6, 96), "float32", mix, key_for("vmap weight", op))
    x, w, b = (None if a is None else np.asarray(a) for a in args[:3])
    w, b = (None if a is None else np.stack([a + 0.1 * i for i in range(4)]) for a in (w, b))
    fn = jax.vmap(lambda x, w, b: norm(op, x, w, b, eps=EPS), in_axes=(0, 0, 0))
    y = np.asarray(run(backend, fn, x, w, b, launches=0))
    for i in range(4):
        ref = reference(op, x[i], w[i], None if b is None else b[i], eps=EPS)
        assert_close(y[i], *ref["y"], "float32", f"example {i}")


def per_example_grads(op):
    """vmap over examples of x, the weight and bias, and the cotangent of the gradients."""

    def loss(x, w, b, g):
        return jnp.sum(norm(op, x, w, b, eps=EPS, weight_offset=0.5) * g)

    return jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))


PER_EXAMPLE = (3, 5, 64)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backends())
def test_vmap_of_grad_with_batched_weights(backend, op):
    """Per-example gradients with a batched weight (and bias): the XLA reference, vmapped
    (with a shared weight: ``test_contract.py``)."""
    batch = PER_EXAMPLE[0]
    mix = MIXES["fp32_params_offset"]
    args = operands(backend, op, PER_EXAMPLE, "float32", mix, key_for("per example", op))
    x, w, b, _, g, _ = (None if a is None else np.asarray(a) for a in args)
    w, b = (None if a is None else np.stack([a + 0.1 * i for i in range(batch)]) for a in (w, b))
    grads = run(backend, per_example_grads(op), x, w, b, g, launches=0)
    for i in range(batch):
        wi, bi = (None if a is None else a[i] for a in (w, b))
        ref = reference(op, x[i], wi, bi, g[i], eps=EPS, offset=0.5)
        for grad, name in zip(grads, ("dx", "dweight", "dbias"), strict=True):
            if ref[name] is None:
                assert grad is None
            else:
                assert_close(np.asarray(grad)[i], *ref[name], "float32", f"{name} of example {i}")


def sin_loss(op):
    def loss(x, w, b):
        return jnp.sum(jnp.sin(norm(op, x, w, b, eps=EPS).astype(jnp.float32)))

    return loss


# -- forward mode -----------------------------------------------------------------------------

JVP_SHAPE = {"cpu": (3, 257), "gpu": (3, 1000)}
JVP_MIXES = ("plain", "weight_residual_prenorm", "all", "mixed_params_prenorm_bf16_out")


def jvp_of(op, mix):
    """(x, weight, bias, residual), their tangents -> ``jax.jvp`` of ``forward(op, mix)``."""

    def fn(args, tangents):
        return jax.jvp(forward(op, mix), tuple(args), tuple(tangents))

    return fn


def jvp_magnitude(op, h, w, b, th, tw, tb, *, eps, offset):
    """The size of the terms that make y's tangent along (th, tw, tb) (numpy float64; th
    may have extra leading axes)."""
    ref = reference(op, np.asarray(h), eps=eps)
    terms, rstd = ref["terms"], ref["rstd"]
    t = np.abs(np.asarray(th, np.float64))
    if op == "layer_norm":
        t = t + t.mean(axis=-1, keepdims=True)
    mag = rstd * (t + terms * (terms * t).mean(axis=-1, keepdims=True))
    if w is not None:
        w64, tw64 = (np.asarray(a, np.float64) for a in (w, tw))
        mag = mag * np.abs(w64 + offset) + terms * np.abs(tw64)
    if b is not None:
        mag = mag + np.abs(np.asarray(tb, np.float64))
    return mag


def check_jvp(op, mix, args, tangents, out, what):
    """``jvp_of(op, mix)``'s results against jax.jvp of the float64 jnp norm."""
    (x, w, b, r), (tx, tw, tb, tr) = args, tangents
    (y, _), (ty, th) = out if mix.prenorm else ((out[0], None), (out[1], None))
    h_ref = np_h(x, r)
    tx64, tr64 = (np.asarray(0.0 if a is None else a, np.float64) for a in (tx, tr))
    th_ref, th_mag = tx64 + tr64, np.abs(tx64) + np.abs(tr64)
    with jax.enable_x64(True):
        fn = jnp_norm(op == "rms_norm", mix.eps, mix.offset)
        ty_ref = jax.jvp(fn, tuple(f64(h_ref, w, b)), tuple(f64(th_ref, tw, tb)))[1]
    out_dtype = mix.dtypes(op, x.dtype.name)[2]
    assert ty.dtype == y.dtype == out_dtype and ty.shape == x.shape, what
    ref = reference(op, h_ref, w, b, eps=mix.eps, offset=mix.offset)
    assert_close(y, *ref["y"], out_dtype, f"y {what}")
    mag = jvp_magnitude(op, h_ref, w, b, th_mag, tw, tb, eps=mix.eps, offset=mix.offset)
    # th = tx + tr is rounded to x's dtype, as by JAX's jvp of the unfused add (XLA on the
    # CPU may fold the round trip away): ty is as precise as the coarser of the two dtypes
    coarser = max(x.dtype.name, out_dtype, key=lambda d: jnp.finfo(d).eps)
    assert_close(ty, np.asarray(ty_ref), mag, coarser, f"ty {what}")
    if mix.prenorm:
        assert th.dtype == x.dtype, what
        assert_close(th, th_ref, th_mag, x.dtype.name, f"th {what}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    ("backend", "dtype"), [backend_param(b, d) for b in BACKENDS for d in ("float32", "bfloat16")]
)
def test_jvp(backend, dtype, op):
    """``jax.jvp`` along x, the residual, weight and bias: the forward kernel and XLA's
    tangent."""
    shape = JVP_SHAPE[backend]
    cases = []
    for name in JVP_MIXES:
        mix = MIXES[name]
        args = operands(backend, op, shape, dtype, mix, key_for("jvp", op, dtype, name))[:4]
        tangents = operands(backend, op, shape, dtype, mix, key_for("jvp t", op, dtype, name))
        cases.append((name, args, tangents[:4]))
    fns = [jvp_of(op, MIXES[name]) for name, _, _ in cases]

    def every(cases):
        return [fn(a, t) for fn, (a, t) in zip(fns, cases, strict=True)]

    outs = run(backend, every, [(a, t) for _, a, t in cases], launches=len(cases))
    for (name, args, tangents), out in zip(cases, outs, strict=True):
        check_jvp(op, MIXES[name], args, tangents, out, f"{op} {name} {dtype}")


JACOBIAN_SHAPE = (2, 7)


def jacobians(op):
    """``jax.jacfwd`` of the norm w.r.t. x and the weight (and bias)."""

    def fn(x, params):
        return jax.jacfwd(lambda x, p: OPS[op](x, *p, eps=EPS), argnums=(0, 1))(x, params)

    return fn


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backends())
def test_jacfwd(backend, op):
    mix = Mix(weight="float32", bias="float32")
    x, w, b, _, _, _ = operands(backend, op, JACOBIAN_SHAPE, "float32", mix, key_for("jac", op))
    params = (w,) if op == "rms_norm" else (w, b)
    jx, jp = run(backend, jacobians(op), x, params, launches=1)
    basis = np.eye(x.size).reshape(x.size, *x.shape)  # one tangent per element of x
    zero = np.zeros(x.shape)
    with jax.enable_x64(True):
        fn = jnp_norm(op == "rms_norm", EPS, 0.0)
        ref = jax.jacfwd(lambda x, p: fn(x, *p, *[None] * (2 - len(p))), argnums=(0, 1))
        rx, rp = ref(*f64(x), tuple(f64(*params)))
    # the magnitudes of the tangents along each basis vector, that axis moved last
    mag = jvp_magnitude(op, x, w, b, basis, 0 * w, 0 * w, eps=EPS, offset=0.0)
    assert_close(jx, rx, np.moveaxis(mag, 0, -1).reshape(jx.shape), "float32", "d y / d x")
    eye = np.eye(x.shape[-1])[:, None]
    for i, (got, want) in enumerate(zip(jp, rp, strict=True)):
        tw, tb = (eye, 0 * w) if i == 0 else (0 * w, eye)
        mag = jvp_magnitude(op, x, w, b, zero, tw, tb, eps=EPS, offset=0.0)
        assert_close(got, want, np.moveaxis(mag, 0, -1), "float32", f"d y / d param {i}")


def hvp(op):
    """``jax.jvp`` of the gradient of ``sin_loss``: Hessian-vector products."""
    grad = jax.grad(sin_loss(op), argnums=(0, 1, 2))

    def fn(args, tangents):
        return jax.jvp(grad, tuple(args), tuple(tangents))

    return fn


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backends())
def test_hessian_vector_product(backend, op):
    """Forward over reverse: each element within TOL of the largest of its array."""
    mix = Mix(weight="float32", bias="float32")
    x, w, b, _, _, _ = operands(backend, op, (3, 64), "float32", mix, key_for("hvp", op))
    tx, tw, tb, _, _, _ = operands(backend, op, (3, 64), "float32", mix, key_for("hvp t", op))
    grads, hvps = run(backend, hvp(op), (x, w, b), (tx, tw, tb), launches=0)
    with jax.enable_x64(True):
        fn = jnp_norm(op == "rms_norm", EPS, 0.0)
        grad = jax.grad(lambda x, w, b: jnp.sum(jnp.sin(fn(x, w, b))), argnums=(0, 1, 2))
        ref = jax.jvp(grad, tuple(f64(x, w, b)), tuple(f64(tx, tw, tb)))
    whats = ["grad"] * 3 + ["hvp"] * 3
    for got, want, what in zip((*grads, *hvps), (*ref[0], *ref[1]), whats, strict=True):
        if want is None:
            assert got is None
        else:
            assert_close(got, want, np.max(np.abs(np.asarray(want))), "float32", what)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("params_batched", [False, True])
@pytest.mark.parametrize("backend", backends())
def test_vmap_of_jvp(backend, params_batched, op):
    """A batch of x, the residual and their tangents; the weight's and bias's tangents
    batched too, or shared."""
    mix, size = MIXES["all"], 4
    shape = (size, *JVP_SHAPE[backend])
    x, w, b, r, tx, tr = operands(backend, op, shape, "float32", mix, key_for("vmap jvp", op))
    tw, tb = (None if a is None else a * 0.5 for a in (w, b))
    if params_batched:
        tw, tb = (None if a is None else jnp.stack([a * i for i in range(size)]) for a in (tw, tb))
    params_axis = 0 if params_batched else None
    in_axes = ((0, None, None, 0), (0, params_axis, params_axis, 0))
    fn = jax.vmap(jvp_of(op, mix), in_axes=in_axes)
    out = run(backend, fn, (x, w, b, r), (tx, tw, tb, tr), launches=1)
    for i in range(size):
        t_params = [a[i] if params_batched and a is not None else a for a in (tw, tb)]
        one = jax.tree.map(lambda a, i=i: a[i], out)
        check_jvp(op, mix, (x[i], w, b, r[i]), (tx[i], *t_params, tr[i]), one, f"{op} {i}")


# -- accepted argument forms -------------------------------------------------------------------


def accepted_forms(x, w):
    """numpy inputs, a numpy scalar for eps, a float32 weight with bfloat16 x, dtype names."""
    return (
        quack_jax.rms_norm(x, w, eps=np.float32(0.25), out_dtype="bfloat16"),
        quack_jax.layer_norm(jnp.asarray(x, jnp.bfloat16), w, w, eps=1),
    )


@pytest.mark.parametrize("backend", backends())
def test_accepted_argument_forms(backend):
    key = np.asarray(jax.random.key_data(key_for("forms")))
    rng = np.random.default_rng(key)
    x = np.asarray(rng.standard_normal((3, 7)), np.float32)
    w = np.asarray(rng.standard_normal(7), np.float32)
    rms, layer = accepted_forms(x, w)
    assert rms.dtype == layer.dtype == jnp.bfloat16
    assert_close(rms, *reference("rms_norm", x, w, eps=0.25)["y"], "bfloat16", "rms_norm")
    h = np.asarray(jnp.asarray(x, jnp.bfloat16))
    assert_close(layer, *reference("layer_norm", h, w, w, eps=1.0)["y"], "bfloat16", "layer_norm")


# -- the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_reference_gradients_match_autodiff(op):
    """The reference's analytic gradients, against jax.vjp in float64."""
    for shape, mix in (((3, 40), MIXES["all"]), ((2, 2, 7), Mix(prenorm=True))):
        x, w, b, r, dy, dh = operands("cpu", op, shape, "float32", mix, key_for("autodiff", shape))
        h = np_h(x, r)
        ref = reference(op, h, w, b, dy, dh, eps=mix.eps, offset=mix.offset)
        kw = dict(rms=op == "rms_norm", eps=mix.eps, offset=mix.offset)
        autodiff = jax64_grads(h, w, b, dy, dh, **kw)
        for grad, name in zip(autodiff, ("dx", "dweight", "dbias"), strict=True):
            assert (grad is None) == (ref[name] is None)
            if grad is not None:
                assert_close(grad, *ref[name], "float64", f"{name} {shape}")


# -- CUDA lowering (kernels compiled with CuTe-DSL, no GPU needed) -----------------------------


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def cuda(kernel_dir, monkeypatch):
    """Lower for sm_90a, compiling into a cache shared by this module's tests."""
    monkeypatch.setenv("QUACK_JAX_CACHE", str(kernel_dir))
    monkeypatch.setenv("QUACK_JAX_CUDA_ARCH", "sm_90a")
    monkeypatch.setattr(_cache, "_memory", {})


def launches(fn, *args):
    return cuda_text(fn, *args).count(f"custom_call @{_ffi.TARGET}")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 65536])
def test_persistent_grid_is_one_wave_of_the_devices_clusters(monkeypatch, n):
    """A persistent kernel's grid is the driver's count of the clusters the device holds
    at once (never more than the SM-count estimate, which overcounts 16-CTA clusters on
    the H200 at n = 65536), or the row blocks if fewer."""
    seen = []
    resident = _primitive.resident_clusters

    def spy(kernel, tiling, target):
        clusters = resident(kernel, tiling, target)
        estimate = resident(kernel, tiling, dataclasses.replace(target, device=None))
        seen.append((clusters, estimate))
        return clusters

    monkeypatch.setattr(_primitive, "resident_clusters", spy)
    x = jax.ShapeDtypeStruct((8192, n), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((n,), jnp.float32)

    def loss(x, w):
        return quack_jax.rms_norm(x, w).astype(jnp.float32).sum()

    text = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).as_text()
    grids = [int(g.split(",", 1)[0]) for g in text.split("grid = dense<[")[1:]]
    assert len(seen) == len(grids) == 2  # forward and backward
    for (clusters, estimate), launched in zip(seen, grids, strict=True):
        assert 1 <= clusters <= estimate
        assert launched == clusters  # 8192 rows are more row blocks than a wave holds


@pytest.mark.cutlass
@pytest.mark.parametrize("op", OPS)
def test_cuda_lowering_launches_forward_and_backward_kernels(cuda, op):
    mix = Mix(weight="x", bias="x")
    args = structs(op, (4, 7, 1000), "bfloat16", mix)
    assert launches(forward(op, mix), *args[:4]) == 1
    assert {k[0] for k in _cache._memory} == {f"{op}_fwd"}
    assert launches(forward_backward(op, mix), *args) == 2
    assert {k[0] for k in _cache._memory} == {f"{op}_fwd", f"{op}_bwd"}


@pytest.mark.cutlass
@pytest.mark.parametrize("op", OPS)
def test_cuda_lowering_sums_weight_gradients_in_the_kernel_at_few_rows(cuda, op):
    """Over few row blocks the backward is one cluster along x that sums its weight- (and
    bias-) gradient partials itself: no reduction follows it. Over many, XLA sums them."""
    mix = Mix(weight="float32", bias="float32")
    for m, summed in ((norm_backward.SUM_CLUSTER_CTAS, True), (4096, False)):
        args = structs(op, (m, ONE_ROW_A_CTA[op]), "bfloat16", mix)
        text = cuda_text(forward_backward(op, mix), *args)
        backward = cluster_dims(text)[-1]
        assert backward == (f"[{m}, 1, 1]" if summed else "1"), (m, backward)
        assert text.count("stablehlo.reduce") == (0 if summed else 1 + (op == "layer_norm"))


LOWERING_MIXES = {
    "residual": Mix(residual=True),
    "weight_f32": Mix(weight="float32"),
    "bias": Mix(weight="x", bias="x"),
    "out_f32": Mix(out="float32"),
    "prenorm": Mix(residual=True, prenorm=True, weight="float32"),
    "prenorm_offset": Mix(prenorm=True, weight="x", offset=1.0),
    "all": Mix(residual=True, prenorm=True, weight="float32", bias="float32", out="float32"),
}


@pytest.mark.cutlass
@pytest.mark.parametrize(
    ("op", "mix"),
    [(op, k) for op in OPS for k in LOWERING_MIXES if op == "layer_norm" or k != "bias"],
)
def test_cuda_lowering_flag_combinations(cuda, op, mix):
    """One kernel forward and with ``jax.jvp`` (the tangent is XLA's), two with the
    backward; none for empty rows, nor for float64."""
    mix = LOWERING_MIXES[mix]
    f, fb, jvp = forward(op, mix), forward_backward(op, mix), jvp_of(op, mix)
    for shape, dtype, kernels in (((3, 5, 512), "bfloat16", 1), ((0, 512), "bfloat16", 0)):
        args = structs(op, shape, dtype, mix)
        assert launches(f, *args[:4]) == kernels
        assert launches(fb, *args) == 2 * kernels
        assert launches(jvp, args[:4], args[:4]) == kernels
    with jax.enable_x64(True):
        args = structs(op, (3, 512), "float64", mix)
        assert launches(f, *args[:4]) == 0
        assert launches(fb, *args) == 0
        assert launches(jvp, args[:4], args[:4]) == 0
