"""Property-based tests on both backends: hypothesis draws shapes, dtypes, options and
values (normal draws at several scales, NaN, +-inf, huge and tiny magnitudes, -inf rows,
ignored and out-of-range labels) and each op is compared with a float64 reference
(``checks.assert_close``): the values, NaN and infinities where the reference has them,
and the gradient on rows whose inputs are finite. The "cpu" backend draws row lengths
1-300; the "gpu" one draws row lengths at which each family's SPEC builds the kernels of
every mix drawn.
"""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close, backends, gpu_lengths
from test_cross_entropy import reference_rows
from test_norm import jax64_grads, np_h, np_norm, np_stats

import quack_jax
from quack_jax._registry import specs
from quack_jax.norm.spec import MIX_SIZES, OPERAND_MIXES, forward

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

DTYPES = ("float32", "bfloat16", "float16")
# the GPU runs draw row lengths from these: the norms' among those at which their SPEC
# builds every operand mix (``norm.spec.MIX_SIZES``), the others' among their test lengths
GPU_SIZES = {"softmax": (1, 7, 100, 1024, 5000), "norm": (7, 1000, 4096), "ce": (7, 1000)}
CE_DTYPES = {"cpu": DTYPES, "gpu": ("float32", "bfloat16")}
MAX_LEAD = 5  # the most rows of each of the (one or two) leading axes drawn
CE_OPTIONS = [
    dict(reduction=r, label_smoothing=s, z_loss=z, logit_softcap=c, return_lse=lse)
    for r, s, z, c, lse in itertools.product(
        ("none", "sum", "mean"), (0.0, 0.1), (0.0, 1e-4), (None, 30.0), (False, True)
    )
]
# The same draws on every run, so CI is reproducible; QUACK_JAX_FUZZ_EXAMPLES=N runs N
# fresh random draws per test instead (a failure prints its inputs).
EXPLORE = int(os.environ.get("QUACK_JAX_FUZZ_EXAMPLES", "0"))
SETTINGS = hypothesis.settings(
    max_examples=EXPLORE or 40,  # the CPU's; the GPU's 60
    derandomize=not EXPLORE,
    deadline=None,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)


@st.composite
def arrays(draw, sizes, dtypes, huge: float):
    """(x as float32 numpy holding values of ``dtype``, dtype): leading dims of 0-MAX_LEAD rows,
    values of one scale with specials sprinkled in, and maybe a row of -inf."""
    dtype = draw(st.sampled_from(dtypes))
    lead = draw(st.lists(st.integers(0, MAX_LEAD), min_size=1, max_size=2))
    n = draw(sizes)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1.0, 30.0, 1e-3]))
    x = scale * rng.standard_normal((*lead, n))
    specials = [np.nan, np.inf, -np.inf, huge, -huge, 1e-30, 0.0]
    count = draw(st.integers(0, 3)) if x.size else 0
    for _ in range(count):
        x.flat[rng.integers(x.size)] = specials[rng.integers(len(specials))]
    if x.size and draw(st.booleans()):
        x.reshape(-1, n)[rng.integers(x.size // n)] = -np.inf
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)), dtype


def finite_rows(*arrays):
    """Rows (over the last axis) where every array is finite."""
    return np.all([np.isfinite(a).all(axis=-1) for a in arrays], axis=0)


def assert_matches(out, ref, dtype, what, mag=None):
    """``checks.assert_close`` against the float64 ``ref`` as the output's dtype holds it
    (a float32 loss of 1e56 is inf), with the size of the terms that make each element
    (``mag``, default the reference itself) plus the row's largest: a row mixes scales and
    specials, and its largest terms enter each element through the row's reductions."""
    out, ref = np.asarray(out), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, what
    held = ref.astype(out.dtype).astype(np.float64)
    ref = np.where(np.isinf(held), held, ref)
    mag = np.abs(ref) if mag is None else np.asarray(mag, np.float64)
    mag = np.where(np.isfinite(mag), mag, 0.0)
    mag = mag + (np.max(mag, axis=-1, keepdims=True, initial=0.0) if mag.ndim else mag)
    # assert_close compiles its operations for each shape, and the draws' shapes vary: it
    # gets the elements as one row, padded with NaN (NaN matches NaN) to a few widths
    width = max(1 << max(out.size - 1, 0).bit_length(), 4096)
    out, ref, mag = (
        np.pad(np.float64(a).ravel(), (0, width - a.size), constant_values=pad)
        for a, pad in ((out, np.nan), (ref, np.nan), (mag, 0.0))
    )
    assert_close(out, ref, mag, dtype, what)


# -- the programs under test (one jitted function each, so prebuild can lower them) ----


def softmax_program(log):
    fn = quack_jax.log_softmax if log else quack_jax.softmax

    def program(x, dy):
        y, vjp = jax.vjp(fn, x)
        return y, vjp(dy)[0]

    return program


def norm_program(rms, mix):
    norm = forward("rms_norm" if rms else "layer_norm", mix)

    def program(x, w, b, r, dy, dh):
        out, vjp = jax.vjp(lambda x, w, b: norm(x, w, b, r), x, w, b)
        y, h = out if mix.prenorm else (out, None)
        return y, h, *vjp((dy, dh) if mix.prenorm else dy)

    return program


def ce_program(options):
    def program(x, labels):
        def loss(x):
            out = quack_jax.cross_entropy(x, labels, **options)
            value = out[0] if options["return_lse"] else out
            total = jnp.sum(value) if options["reduction"] == "none" else value
            return total + (jnp.sum(out[1]) if options["return_lse"] else 0.0), out

        return jax.grad(loss, has_aux=True)(x)[::-1]

    return program


# -- the checks -----------------------------------------------------------------------


def check_softmax(x, dtype, log, seed):
    xj = jnp.asarray(x, dtype)
    dy = jnp.asarray(np.random.default_rng(seed).standard_normal(x.shape), dtype)
    y, dx = jax.jit(softmax_program(log))(xj, dy)
    with jax.enable_x64(True):
        ref_fn = jax.nn.log_softmax if log else jax.nn.softmax
        ref_y, ref_vjp = jax.vjp(ref_fn, jnp.asarray(np.asarray(xj, np.float64)))
        (ref_dx,) = ref_vjp(jnp.asarray(np.asarray(dy, np.float64)))
    assert y.dtype == dx.dtype == xj.dtype
    assert_matches(y, ref_y, dtype, "y")
    rows = finite_rows(x) & np.isfinite(np.asarray(ref_y)).all(axis=-1)
    p, ady = np.asarray(jax.nn.softmax(np.asarray(xj, np.float32)), np.float64), np.abs(dy)
    total = np.sum(ady * (1.0 if log else p), axis=-1, keepdims=True)
    mag = ady + p * total if log else p * (ady + total)
    assert_matches(np.asarray(dx)[rows], np.asarray(ref_dx)[rows], dtype, "dx", mag[rows])


def check_norm(x, dtype, rms, mix, seed):
    rng = np.random.default_rng(seed)
    n = x.shape[-1]

    def vector(kind, shift):
        if kind is None:
            return None
        return jnp.asarray(
            shift + 0.5 * rng.standard_normal(n), dtype if kind == "x" else "float32"
        )

    xj = jnp.asarray(x, dtype)
    w, b = vector(mix.weight, 1.0), None if rms else vector(mix.bias, 0.0)
    r = jnp.asarray(rng.standard_normal(x.shape), dtype) if mix.residual else None
    y_dtype = mix.out or dtype
    dy = jnp.asarray(rng.standard_normal(x.shape), y_dtype)
    dh = jnp.asarray(rng.standard_normal(x.shape), dtype) if mix.prenorm else None
    y, h, dx, dw, db = jax.jit(norm_program(rms, mix))(xj, w, b, r, dy, dh)
    h_ref = np_h(np.asarray(xj), None if r is None else np.asarray(r))
    ref_y = np_norm(h_ref, w, b, rms=rms, eps=mix.eps, offset=mix.offset)
    assert y.dtype == y_dtype
    assert_matches(y, ref_y, dtype, "y")
    if h is not None:
        np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_ref, np.float32))
    ref_dx, ref_dw, ref_db = jax64_grads(
        h_ref, w, b, dy, dh, rms=rms, eps=mix.eps, offset=mix.offset
    )
    rows = finite_rows(np.asarray(h_ref, np.float64)) & np.isfinite(ref_y).all(axis=-1)
    xhat, rstd = np_stats(h_ref, rms, mix.eps)  # dx's terms cancel: judge it by their size
    g = np.abs(np.asarray(dy, np.float64) * (1.0 if w is None else np.asarray(w, np.float64)))
    mag = rstd * (g + np.abs(xhat) * np.mean(g * np.abs(xhat), axis=-1, keepdims=True))
    mag = mag + rstd * np.mean(g, axis=-1, keepdims=True) + (0.0 if dh is None else np.abs(dh))
    assert_matches(np.asarray(dx)[rows], ref_dx[rows], dtype, "dx", mag[rows])
    if rows.all():  # the vector gradients sum over every row
        for got, ref, what in ((dw, ref_dw, "dweight"), (db, ref_db, "dbias")):
            if ref is not None:
                assert_matches(got, ref, dtype, what)


def check_cross_entropy(x, dtype, options, seed):
    rng = np.random.default_rng(seed)
    lead, n = x.shape[:-1], x.shape[-1]
    pick = rng.random(lead)
    labels = np.where(pick < 0.2, -100, np.where(pick > 0.95, n + 2, rng.integers(0, n, lead)))
    if rng.random() < 0.2:
        labels[...] = -100  # every row ignored
    xj = jnp.asarray(x, dtype)
    out, grad = jax.jit(ce_program(options))(xj, jnp.asarray(labels, jnp.int32))
    reduction, return_lse = options["reduction"], options["return_lse"]
    args = (options["label_smoothing"], options["z_loss"], options["logit_softcap"])
    outside = (labels != -100) & ((labels < 0) | (labels >= n))
    with jax.enable_x64(True):

        def ref_loss(x64):
            rows, lse = reference_rows(x64, jnp.asarray(labels), *args)
            rows = jnp.where(jnp.asarray(outside), jnp.nan, rows)
            kept = jnp.sum(jnp.asarray(labels) != -100)
            value = {"none": rows, "sum": jnp.sum(rows), "mean": jnp.sum(rows) / kept}[reduction]
            total = jnp.sum(value) if reduction == "none" else value
            return total + (jnp.sum(lse) if return_lse else 0.0), (value, lse)

        x64 = jnp.asarray(np.asarray(xj, np.float64))
        (_, (ref_value, ref_lse)), ref_grad = jax.value_and_grad(ref_loss, has_aux=True)(x64)
    value = out[0] if return_lse else out
    clean = bool(finite_rows(x).all() and not outside.any())
    if reduction == "none" or clean:  # the loss is lse - target (and more): their size
        terms = np.abs(np.asarray(ref_value)) + np.where(labels == -100, 0.0, np.abs(ref_lse))
        terms = terms if reduction == "none" else np.sum(terms)
        assert_matches(value, ref_value, "float32", "loss", terms)
    if return_lse:
        assert_matches(out[1], ref_lse, "float32", "lse")
    if reduction != "none" and not clean:
        return  # a NaN or infinite row makes the whole sum's cotangent NaN
    # the kernels form p = exp(x - lse) from a float32 lse, which keeps 24 bits of it: rows
    # with |lse| >= 1e4 lose that much of p (a known limit), so they are left out here
    small = np.abs(np.asarray(ref_lse)) < 1e4
    rows = finite_rows(x) & ~outside & small & np.isfinite(np.asarray(ref_grad)).all(axis=-1)
    # an element is its row's cotangent times terms of size up to ~1 (p, the one-hot, the
    # smoothing) that can cancel (one class: p - 1 = 0, leaving the z-loss term): the
    # bound scales with the cotangent, not only with what is left
    kept = max(np.sum(labels != -100), 1)
    cotangent = np.where(labels == -100, 0.0, 1.0 / kept if reduction == "mean" else 1.0)
    cotangent = cotangent + (1.0 if return_lse else 0.0)
    mag = np.abs(np.asarray(ref_grad)) + cotangent[..., None]
    grad, ref_grad = np.asarray(grad)[rows], np.asarray(ref_grad)[rows]
    assert_matches(grad, ref_grad, dtype, "dlogits", mag[rows])


# -- the tests ------------------------------------------------------------------------

SOFTMAX_HUGE, NORM_HUGE = 1e30, 1e15  # squares of the norms' values stay within float32


def sizes(backend, family):
    if backend == "cpu":
        return st.integers(1, 300)
    return st.sampled_from(GPU_SIZES[family])


def given(backend, *strategies):
    """hypothesis.given with the backend's number of examples."""
    settings = hypothesis.settings(
        SETTINGS, max_examples=EXPLORE or (60 if backend == "gpu" else 40)
    )
    return lambda check: settings(hypothesis.given(*strategies)(check))


@pytest.mark.parametrize("backend", backends())
def test_softmax(backend):
    @given(
        backend,
        arrays(sizes(backend, "softmax"), DTYPES, SOFTMAX_HUGE),
        st.booleans(),
        st.integers(0, 99),
    )
    def softmax(data, log, seed):
        check_softmax(*data, log, seed)

    softmax()


@pytest.mark.parametrize("backend", backends())
def test_norms(backend):
    @given(
        backend,
        arrays(sizes(backend, "norm"), DTYPES, NORM_HUGE),
        st.booleans(),
        st.sampled_from(OPERAND_MIXES),
        st.integers(0, 99),
    )
    def norms(data, rms, mix, seed):
        check_norm(*data, rms, mix, seed)

    norms()


@pytest.mark.parametrize("backend", backends())
def test_cross_entropy(backend):
    @given(
        backend,
        arrays(sizes(backend, "ce"), CE_DTYPES[backend], SOFTMAX_HUGE),
        st.sampled_from(CE_OPTIONS),
        st.integers(0, 99),
    )
    def cross_entropy(data, options, seed):
        check_cross_entropy(*data, options, seed)

    cross_entropy()


def test_gpu_draws_are_built():
    """The GPU runs draw only row lengths whose kernels the families' SPECs build."""
    assert set(GPU_SIZES["norm"]) <= set(MIX_SIZES)
    for family, op in (("softmax", "softmax"), ("ce", "cross_entropy")):
        assert set(GPU_SIZES[family]) <= gpu_lengths(op)
    assert set(CE_DTYPES["gpu"]) <= set(specs()["cross_entropy"].tests["gpu"].dtypes)
