"""cross_entropy on both backends against a float64 reference (numpy: the per-row loss
and lse of ``reference_rows``, which ``test_fuzz`` differentiates with JAX, and the
closed form of their gradient): per-row losses, lse and their gradient (the forward and
backward kernels), the mean and sum losses' gradient from the forward, every option mix
(label smoothing, z-loss, softcap), special values and labels,
the mean over the rows not ignored, label dtypes, int64 labels, the optax alias, and
the kernels a CUDA lowering launches. What every op has (jit, vmap, checkpoint, scan,
float64, no rows and one row, bad arguments) is tested in ``test_contract.py``.

Inputs are fresh random draws, a fifth of the labels ignored. On the GPU, where the
logits are too large for a float64 copy, they are drawn on the device, the reference
covers a random sample of rows and the whole output is checked for unwritten (NaN)
elements.
"""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import (
    BACKENDS,
    MAX_ELEMENTS,
    SEED,
    assert_close,
    backend_param,
    backends,
    gpu_lengths,
    grid,
    key_for,
    run,
)
from jax.test_util import check_grads

import quack_jax
from quack_jax._registry import specs
from quack_jax.build import lower_for_cuda

IGNORE = -100
OPTIONS = [
    dict(label_smoothing=s, z_loss=z, logit_softcap=c)
    for s, z, c in itertools.product((0.0, 0.1), (0.0, 1e-3), (None, 20.0))
]
# every option mix runs at these row lengths (elsewhere one mix per shape, in turn)
OPTION_SIZES = {"cpu": (1000,), "gpu": (1000, 50257, 262144)}
OPTION_DTYPES = ("float32", "bfloat16")
SPECIAL_OPTIONS = (0, 7)  # none, all
SAMPLED_ROWS = 64


def reference_rows(logits, labels, smoothing=0.0, z_loss=0.0, softcap=None, ignore=IGNORE):
    """float64 per-row loss and lse; ignored rows 0 (by ``where``, so their gradient is
    0). In numpy for numpy arrays, else in JAX (differentiable)."""
    xp, stop = (np, np.asarray) if isinstance(logits, np.ndarray) else (jnp, jax.lax.stop_gradient)
    x = logits.astype(np.float64)
    if softcap is not None:
        x = softcap * xp.tanh(x / softcap)
    top = xp.max(x, axis=-1, keepdims=True)  # logsumexp as jax.nn's
    top = stop(xp.where(xp.isfinite(top), top, 0.0))
    lse = xp.log(xp.sum(xp.exp(x - top), axis=-1)) + top[..., 0]
    logp = x - lse[..., None]
    n = x.shape[-1]
    nll = -xp.take_along_axis(logp, xp.clip(labels, 0, n - 1)[..., None], -1)[..., 0]
    loss = (1 - smoothing) * nll
    if smoothing:  # terms added only when asked for, so 0 * inf does not make a NaN
        loss = loss - smoothing * xp.mean(logp, axis=-1)
    if z_loss:
        loss = loss + z_loss * lse**2
    return xp.where(labels == ignore, 0.0, loss), lse


def reference(logits, labels, g, g_lse, opts):
    """float64 (numpy) per-row loss and lse, NaN where the label is outside [0, n) and
    not ignored; the gradient of ``sum(g * loss + g_lse * lse)``, each of its terms
    present where its factor is not 0 (NaN on rows of outside labels); the magnitude of
    each gradient element's terms, and of each row's loss and lse."""
    smoothing, z_loss, cap = (opts[k] for k in ("label_smoothing", "z_loss", "logit_softcap"))
    x = np.asarray(logits).astype(np.float64)
    labels = np.asarray(labels)
    n = x.shape[-1]
    ignored = labels == IGNORE
    outside = ~ignored & ((labels < 0) | (labels >= n))
    g = np.where(ignored, 0.0, np.asarray(g, np.float64))[:, None]
    gl = np.asarray(g_lse, np.float64)[:, None]
    with np.errstate(all="ignore"):
        loss, lse = reference_rows(x, labels, smoothing, z_loss, cap)
        loss = np.where(outside, np.nan, loss)
        capped = x if cap is None else cap * np.tanh(x / cap)
        p = np.exp(capped - lse[:, None])
        hit = np.arange(n) == labels[:, None]
        # d loss = (1 + 2 z lse) p - (1 - smoothing) hit - smoothing / n; d lse = p
        a = g + gl
        if z_loss:  # (as in reference_rows)
            a = a + np.where(g == 0, 0.0, 2 * z_loss * g * lse[:, None])
        grad = np.where(a == 0, 0.0, a * p) - g * (1 - smoothing) * hit - g * smoothing / n
        grad = np.where(outside[:, None] & (g != 0), np.nan, grad)
        if cap is not None:
            dead = (a == 0) & (g == 0)
            grad = np.where(dead, 0.0, grad * (1 - np.tanh(x / cap) ** 2))
        scale = np.abs(g) * (1 + 2 * z_loss * np.abs(lse[:, None])) + np.abs(gl)
        mag = scale * (p + np.max(p, -1, keepdims=True)) + np.abs(g) * (hit + 1.0 / n)
        mag = np.where(np.isnan(mag), 1.0, mag)  # rows of NaN or inf: exact values
        row_mag = 1 + np.abs(lse) * (1 + z_loss * np.abs(lse))
    return loss, lse, grad, mag, row_mag


def cases():
    """(backend, m, n, dtype, k): the SPEC's grid with the option mixes in turn (on the
    GPU also its tensors too large for a float64 copy, in float32 and bfloat16), and
    every option mix at three row lengths on the GPU (one warp per row, a cluster of
    odd-length rows, the largest), one on the CPU."""
    out = []
    for backend in BACKENDS:
        shapes = [p.values[1:] for p in grid("cross_entropy", backends=(backend,))]
        if backend == "gpu":
            tests = specs()["cross_entropy"].tests[backend]
            shapes += [
                (m, n, d)
                for m, n, d in itertools.product(tests.rows, tests.sizes, OPTION_DTYPES)
                if m * n > MAX_ELEMENTS
            ]
        mine = [(backend, *shape, i % len(OPTIONS)) for i, shape in enumerate(shapes)]
        for n, d, k in itertools.product(OPTION_SIZES[backend], OPTION_DTYPES, range(len(OPTIONS))):
            if (backend, 7, n, d, k) not in mine:
                mine.append((backend, 7, n, d, k))
        out += mine
    return out


CASES = cases()


def draw(m, n, dtype, *key):
    """Logits, labels (a fifth ignored), and random cotangents of the loss and lse (0 for
    the lse of every other ignored row: their gradient is exactly 0). Drawn in numpy;
    logits too large for a float64 copy on the device."""
    seed = np.asarray(jax.random.key_data(key_for("ce", m, n, dtype, *key)))
    rng = np.random.default_rng(seed)
    labels = np.where(rng.random(m) < 0.2, IGNORE, rng.integers(0, n, m))
    g = rng.standard_normal(m, np.float32)
    g_lse = np.where((labels == IGNORE) & (np.arange(m) % 2 == 0), 0, rng.standard_normal(m))
    if m * n > MAX_ELEMENTS // 4:
        logits = _device_logits(jax.random.key(seed[-1]), m, n, dtype)
    else:
        logits = (4.0 * rng.standard_normal((m, n), np.float32)).astype(jnp.dtype(dtype))
    arrays = logits, labels.astype(np.int32), g, (0.1 * g_lse).astype(np.float32)
    return tuple(jnp.asarray(a) for a in arrays)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _device_logits(key, m, n, dtype):
    return (4.0 * jax.random.normal(key, (m, n), jnp.float32)).astype(dtype)


def sampled_rows(m, n):
    """None (all rows), or a random sample where a float64 copy of the logits would be
    large."""
    if m * n > MAX_ELEMENTS // 4:
        return np.sort(np.random.default_rng(SEED).choice(m, SAMPLED_ROWS, replace=False))
    return None


def host(rows, *arrays):
    """numpy copies of the arrays (of their ``rows``; None: all), the floating ones in
    float64 (then ``assert_close`` compiles its comparison once per shape, whatever the
    dtype)."""
    return [as64(a if rows is None else a[rows]) for a in arrays]


def as64(x):
    x = np.asarray(x)
    return x.astype(np.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x


def scalar(x):
    return np.reshape(as64(x), 1)


def assert_written(*outs):
    for out in outs:
        assert not bool(jnp.isnan(out).any()), f"unwritten or NaN elements (seed {SEED})"


def loss_and_grad(opts):
    """Per-row losses and lse, and their vjp: the forward kernel, then the backward."""

    def f(logits, labels, g, g_lse):
        def rows(x):
            return quack_jax.cross_entropy(x, labels, reduction="none", return_lse=True, **opts)

        (loss, lse), vjp = jax.vjp(rows, logits)
        return loss, lse, vjp((g, g_lse))[0]

    return f


def mean_and_sum(opts):
    """The mean and the sum loss with their gradients: one forward kernel each, which
    writes the gradient."""

    def f(logits, labels):
        def loss(reduction):
            return lambda x: quack_jax.cross_entropy(x, labels, reduction=reduction, **opts)

        return (*jax.value_and_grad(loss("mean"))(logits), *jax.value_and_grad(loss("sum"))(logits))

    return f


def check_per_row(backend, logits, labels, g, g_lse, opts, rows=None):
    """loss_and_grad against the reference on ``rows`` (None: all); the gradient of the
    rows that neither cotangent reaches is 0."""
    dtype = logits.dtype.name
    loss, lse, grad = run(backend, loss_and_grad(opts), logits, labels, g, g_lse, launches=2)
    assert grad.dtype == logits.dtype and loss.dtype == lse.dtype == jnp.float32
    if rows is not None:
        assert_written(loss, lse, grad)
    logits, labels, g, g_lse, loss, lse, grad = host(
        rows, logits, labels, g, g_lse, loss, lse, grad
    )
    ref_loss, ref_lse, ref_grad, mag, row_mag = reference(logits, labels, g, g_lse, opts)
    dead = (labels == IGNORE) & (g_lse == 0)
    assert (grad[dead] == 0).all(), f"dlogits of rows no cotangent reaches (seed {SEED})"
    assert (loss[labels == IGNORE] == 0).all(), f"loss of ignored rows (seed {SEED})"
    assert_close(loss, ref_loss, row_mag, "float32", "loss")
    assert_close(lse, ref_lse, row_mag, "float32", "lse")
    assert_close(grad, ref_grad, mag, dtype, "dlogits", logits=logits)


def check_mean_and_sum(backend, logits, labels, opts, rows=None):
    """mean_and_sum against the reference on ``rows`` (None: all, and the losses); the
    gradient of ignored rows is 0."""
    dtype = logits.dtype.name
    out = run(backend, mean_and_sum(opts), logits, labels, launches=2)
    if rows is not None:
        assert_written(out[1], out[3])
    count = int(jnp.sum(labels != IGNORE))  # over all rows: the mean's divisor
    logits, labels = host(rows, logits, labels)
    kept = labels != IGNORE
    for (loss, grad), reduction in zip((out[:2], out[2:]), ("mean", "sum"), strict=True):
        assert loss.dtype == jnp.float32 and grad.dtype.name == dtype
        loss, (grad,) = scalar(loss), host(rows, grad)
        w = kept / max(count, 1) if reduction == "mean" else kept
        ref_loss, _, ref_grad, mag, row_mag = reference(logits, labels, w, 0 * w, opts)
        what = f"dlogits of the {reduction}"
        assert (grad[~kept] == 0).all(), f"{what}: ignored rows (seed {SEED})"
        assert_close(grad, ref_grad, mag, dtype, what, logits=logits)
        if rows is None:
            total, size = np.sum(ref_loss), np.sum(row_mag)
            if reduction == "mean":
                total, size = total / count if count else np.nan, size / max(count, 1)
            assert_close(loss, scalar(total), scalar(size), "float32", reduction)


@pytest.mark.parametrize(("backend", "m", "n", "dtype", "k"), [backend_param(*c) for c in CASES])
def test_per_row_losses_and_their_gradient(backend, m, n, dtype, k):
    """reduction="none" with lse: the forward kernel, then the backward kernel."""
    check_per_row(backend, *draw(m, n, dtype, k), OPTIONS[k], sampled_rows(m, n))


@pytest.mark.parametrize(("backend", "m", "n", "dtype", "k"), [backend_param(*c) for c in CASES])
def test_mean_and_sum_gradient_from_the_forward(backend, m, n, dtype, k):
    """A mean or sum loss under jax.grad: one forward kernel that also writes the
    gradient."""
    logits, labels, _, _ = draw(m, n, dtype, k)
    check_mean_and_sum(backend, logits, labels, OPTIONS[k], sampled_rows(m, n))


def special_inputs(n, dtype):
    """12 rows: NaN, +inf, all -inf, one -inf, NaN ignored, +-1e30, label n, label -1,
    ignored, and plain rows."""
    seed = np.asarray(jax.random.key_data(key_for("special", n, dtype)))
    x = 3.0 * np.random.default_rng(seed).standard_normal((12, n), np.float32)
    x[0, n // 2] = x[4, n // 3] = np.nan
    x[1, n - 1], x[2], x[3, 0] = np.inf, -np.inf, -np.inf
    x[5, 0], x[5, n - 1] = 1e30, -1e30
    labels = np.arange(12) % n
    labels[[4, 6, 7, 8]] = IGNORE, n, -1, IGNORE
    with np.errstate(over="ignore"):  # 1e30 is inf in float16
        return jnp.asarray(x.astype(jnp.dtype(dtype))), jnp.asarray(labels, jnp.int32)


@pytest.mark.parametrize("k", SPECIAL_OPTIONS)
@pytest.mark.parametrize(("backend", "n", "dtype"), grid("cross_entropy", special=True))
def test_special_values_and_labels(backend, n, dtype, k):
    """NaN, +inf, all -inf rows, huge magnitudes, out-of-range and ignored labels: NaN
    and inf where the float64 reference has them, ignored rows 0 with gradient 0."""
    logits, labels = special_inputs(n, dtype)
    g = jnp.ones(labels.shape, jnp.float32)
    check_per_row(backend, logits, labels, g, 0 * g, OPTIONS[k])
    check_mean_and_sum(backend, logits, labels, OPTIONS[k])


# the shape of the small tests' logits (the CPU's special values': the same comparisons)
SMALL_M, SMALL_N = 12, 40


@pytest.mark.parametrize("backend", backends())
def test_mean_loss_with_lse(backend):
    """A mean loss with return_lse (the per-row kernels), differentiated through both
    outputs."""
    logits, labels, _, _ = draw(SMALL_M, SMALL_N, "float32", "lse")

    def f(x, labels):
        def total(x):
            loss, lse = quack_jax.cross_entropy(x, labels, return_lse=True, z_loss=0.01)
            return loss + jnp.sum(jnp.sin(lse)), (loss, lse)

        (_, (loss, lse)), grad = jax.value_and_grad(total, has_aux=True)(x)
        return loss, lse, grad

    loss, lse, grad = host(None, *run(backend, f, logits, labels, launches=2))
    opts = dict(OPTIONS[0], z_loss=0.01)
    kept = np.asarray(labels) != IGNORE
    w = kept / np.sum(kept)
    ref_loss, ref_lse, _, _, row_mag = reference(logits, labels, w, 0 * w, opts)
    # lse's cotangent is cos of the lse computed: the float32 lse's error, through cos,
    # is large against w + cos(lse) where the two cancel, and is not the gradient's error
    g_lse = np.cos(np.asarray(lse, np.float64))
    _, _, ref_grad, mag, _ = reference(logits, labels, w, g_lse, opts)
    assert_close(lse, ref_lse, row_mag, "float32", "lse")
    mean, size = np.sum(ref_loss) / np.sum(kept), np.sum(row_mag) / np.sum(kept)
    assert_close(scalar(loss), scalar(mean), scalar(size), "float32", "mean")
    assert_close(grad, ref_grad, mag, "float32", "dlogits", logits=logits)


@pytest.mark.parametrize("offset", (1e4, 1e6, 1e7))
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("backend", backends())
def test_large_logits_keep_their_precision(backend, dtype, offset):
    """Logits offset by up to 1e7, where lse's own rounding is a whole unit: the
    gradient (both kernels) within the usual bound of its terms, as at offset 0, and the
    loss within float32's precision of the loss itself, not of lse."""
    rng = np.random.default_rng([SEED, int(offset)])
    x = (offset + 3.0 * rng.standard_normal((SMALL_M, 1000))).astype(jnp.dtype(dtype))
    labels = rng.integers(0, 1000, SMALL_M).astype(np.int32)
    logits, labels = jnp.asarray(x), jnp.asarray(labels)
    g = jnp.asarray(rng.uniform(0.5, 1.5, SMALL_M), jnp.float32)
    check_per_row(backend, logits, labels, g, 0 * g, OPTIONS[0])
    check_mean_and_sum(backend, logits, labels, OPTIONS[0])

    def rows(x, labels):
        return quack_jax.cross_entropy(x, labels, reduction="none")

    (loss,) = host(None, run(backend, rows, logits, labels, launches=1))
    ref_loss, _ = reference_rows(as64(x), np.asarray(labels))
    assert_close(loss, ref_loss, 1.0 + np.abs(ref_loss), "float32", "loss")


@pytest.mark.parametrize("backend", backends())
def test_logits_at_the_float32_limit(backend):
    """Rows of logits near float32's largest value: the exact softmax, not exp(x - lse)
    rounded to 0 or 1, and the losses log(3) and log(2)."""
    logits = jnp.asarray([[3e38, 3e38, 3e38], [3e38, -3e38, 3e38]], jnp.float32)
    labels = jnp.asarray([0, 2], jnp.int32)

    def f(x, labels):
        return jax.value_and_grad(lambda x: quack_jax.cross_entropy(x, labels, reduction="sum"))(x)

    loss, grad = host(None, *run(backend, f, logits, labels, launches=1))
    ref_grad = np.asarray([[-2 / 3, 1 / 3, 1 / 3], [1 / 2, 0.0, -1 / 2]])
    assert_close(grad, ref_grad, np.ones_like(ref_grad), "float32", "dlogits")
    assert_close(scalar(loss), scalar(np.log(3.0) + np.log(2.0)), scalar(1.0), "float32", "sum")


def rows_of(x, y):
    return quack_jax.cross_entropy(x, y, reduction="none")


def sum_of(x, y):
    return quack_jax.cross_entropy(x, y, reduction="sum")


@pytest.mark.parametrize("backend", backends())
def test_mean_counts_rows_not_ignored_labels_and_empty_inputs(backend):
    """The mean divides by the rows not ignored (NaN when all are); int16 labels with
    float16 logits; uint32 labels beyond int32 are out of range; empty inputs."""
    logits, labels, _, _ = draw(8, 10, "float32", "mean")
    labels = np.where(np.asarray(labels) == IGNORE, 5, labels)
    labels[:3] = IGNORE
    ones = np.ones(labels.shape)
    for x, y, what in (
        (logits, jnp.asarray(labels), "float32"),
        (logits.astype(jnp.float16), jnp.asarray(labels, jnp.int16), "float16 int16"),
    ):
        mean, total = run(
            backend, lambda x, y: (quack_jax.cross_entropy(x, y), sum_of(x, y)), x, y, launches=2
        )
        ref_loss, _, _, _, row_mag = reference(x, labels, ones, ones, OPTIONS[0])
        want, size = np.sum(ref_loss), np.sum(row_mag)
        assert_close(scalar(total), scalar(want), scalar(size), "float32", f"sum {what}")
        assert_close(scalar(mean), scalar(want / 5), scalar(size / 5), "float32", f"mean {what}")

    none = run(backend, quack_jax.cross_entropy, logits, jnp.full((8,), IGNORE), launches=1)
    assert np.isnan(none)
    unsigned = jnp.array([0, 3, 2**32 - 1], jnp.uint32)  # the last is out of range, not -1
    out = run(backend, rows_of, logits[:3], unsigned, launches=1)
    assert np.isfinite(out[:2]).all() and np.isnan(out[2])

    empty = jnp.zeros((0, 10)), jnp.zeros((0,), jnp.int32)
    assert run(backend, rows_of, *empty, launches=0).shape == (0,)
    assert run(backend, sum_of, *empty, launches=0) == 0


@pytest.mark.parametrize("backend", backends())
def test_int64_labels_beyond_int32_are_out_of_range(backend):
    """With x64 on, an int64 label beyond int32's range is out of range (its row NaN),
    not wrapped into it."""
    with jax.enable_x64(True):
        logits, labels, _, _ = draw(SMALL_M, SMALL_N, "float64", "int64 labels")
        labels = jnp.maximum(labels, 0).astype(jnp.int64).at[0].set(2**32 + 1)

        def f(x, y):
            return quack_jax.cross_entropy(x, y, reduction="none", label_smoothing=0.2)

        out = run(backend, f, logits, labels, launches=0)
        assert out.dtype == jnp.float64
        assert np.isnan(out[0]) and np.isfinite(out[1:]).all()


@pytest.mark.parametrize("backend", backends())
def test_optax_alias_matches_optax(backend):
    """softmax_cross_entropy_with_integer_labels against optax's in float64: labels in
    [-V, 0) count from the end, others outside [0, V) give NaN; ``axis``; ``where`` of
    the labels' and of the logits' shape; the gradient."""
    optax = pytest.importorskip("optax")
    alias = quack_jax.softmax_cross_entropy_with_integer_labels
    theirs = optax.softmax_cross_entropy_with_integer_labels
    m, n = SMALL_M, SMALL_N
    logits, labels, _, _ = draw(m, n, "float32", "optax")
    labels = np.where(np.asarray(labels) == IGNORE, 7, labels)
    labels[:4] = -1, -n, n, -n - 1
    labels = jnp.asarray(labels)
    rows = jnp.arange(m) % 3 > 0
    mask = jax.random.uniform(key_for("optax", "mask"), logits.shape) > 0.3
    ok = np.asarray(labels >= 0)

    def reference_of(fn, *args, **kw):
        """fn of float64 logits (the first argument), and |lse| + 1 of their rows."""

        def both(x, *rest):
            return fn(x, *rest, **kw), 1 + jnp.abs(jax.nn.logsumexp(x, axis=kw.get("axis", -1)))

        with jax.enable_x64(True):
            x64 = jnp.asarray(args[0]).astype(jnp.float64)
            return tuple(np.asarray(a) for a in jax.jit(both)(x64, *args[1:]))

    def grad_of(fn):
        return jax.grad(lambda x, y: fn(x, y)[4:].sum())

    ours = as64(run(backend, alias, logits, labels, launches=1))
    assert_close(ours, *reference_of(theirs, logits, labels), "float32", "loss")
    assert np.isnan(ours[2]) and np.isnan(ours[3]) and np.isfinite(ours[:2]).all()

    grad = as64(run(backend, grad_of(alias), logits, labels, launches=2))
    ref_grad, _ = reference_of(grad_of(theirs), logits, labels)
    assert_close(grad, ref_grad, 1 + np.abs(ref_grad), "float32", "gradient")

    t = jnp.moveaxis(logits, -1, 0)
    ours = as64(run(backend, lambda x, y: alias(x, y, axis=0), t, labels, launches=1))
    assert_close(ours, *reference_of(theirs, t, labels, axis=0), "float32", "axis=0")

    ours = run(backend, lambda x, y, w: alias(x, y, where=w), logits, labels, rows, launches=1)
    ref = reference_of(theirs, logits, labels, where=rows)
    assert_close(as64(ours), *ref, "float32", "where of the labels' shape")

    args = logits[ok], labels[ok], mask[ok]
    ours = run(backend, lambda x, y, w: alias(x, y, where=w), *args, launches=0)
    ref = reference_of(theirs, *args[:2], where=args[2])
    assert_close(as64(ours), *ref, "float32", "where of the logits' shape")

    for x in (logits.astype(jnp.bfloat16), jnp.moveaxis(logits, -1, 0).astype(jnp.float16)):
        axis = 0 if x.dtype == jnp.float16 else -1
        for w in (None, rows, mask if axis == -1 else None):
            got = jax.eval_shape(functools.partial(alias, axis=axis, where=w), x, labels)
            want = jax.eval_shape(functools.partial(theirs, axis=axis, where=w), x, labels)
            assert got.dtype == want.dtype == x.dtype, "optax's dtype"


@pytest.mark.parametrize(
    ("shape", "axis"),
    [
        ((3, 5, 4, 10), (2, 3)),
        ((3, 5, 4, 10), (-2, -1)),
        ((4, 3, 5, 10), (0, 3)),
        ((4, 3, 5, 10), (3, 0)),
        ((3, 40, 5), (-2,)),
    ],
    ids=str,
)
@pytest.mark.parametrize("backend", backends())
def test_optax_alias_axis_tuple_matches_optax(backend, shape, axis):
    """A tuple ``axis``: the class axes flattened in the order given (trailing ones by a
    reshape, others by a transpose, then the kernels), labels of the other axes' shape,
    some counted from the end or out of range; ``where`` of the labels' and of the
    logits' shape. optax's values, dtype and shape."""
    optax = pytest.importorskip("optax")
    alias = quack_jax.softmax_cross_entropy_with_integer_labels
    theirs = optax.softmax_cross_entropy_with_integer_labels
    axes = {a % len(shape) for a in axis}
    lead = tuple(d for i, d in enumerate(shape) if i not in axes)
    n = int(np.prod([shape[a] for a in axes]))
    keys = jax.random.split(key_for("optax axes", shape, axis), 4)
    logits = jax.random.normal(keys[0], shape)
    labels = jax.random.randint(keys[1], lead, -n, n).ravel().at[:3].set([n, -n - 1, -1])
    labels = labels.reshape(lead)
    rows = jax.random.uniform(keys[2], lead) > 0.3
    mask = jax.random.uniform(keys[3], shape) > 0.3

    def ours(x, y, where):
        return alias(x, y, axis, where)

    for where, launches in ((None, 1), (rows, 1), (mask, 0)):
        got = run(backend, ours, logits, labels, where, launches=launches)
        want = theirs(logits, labels, axis, where)
        assert got.shape == want.shape == lead and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        if where is None:
            np.testing.assert_array_equal(np.isnan(got), (labels < -n) | (labels >= n))


# optax's own tests of softmax_cross_entropy_with_integer_labels (its
# SoftmaxCrossEntropyWithIntegerLabelsTest), re-stated: each runs its assertions on the
# function it is given and returns its result, for the alias and optax's function alike
OPTAX_YS = np.array([[10.0, 1.0, -2.0], [1.0, 4.0, 0.2]], dtype=np.float32)
OPTAX_TS = np.array([1, 0], dtype=np.int32)
OPTAX_MASK = np.array([True, False])
OPTAX_PER_LOGIT_MASK = np.array([[1, 0, 0], [0, 0, 0]]).astype(bool)


def optax_scalar(f, optax):
    exp = optax.softmax_cross_entropy(OPTAX_YS[0], jax.nn.one_hot(OPTAX_TS[0], 3))
    got = jax.jit(f)(OPTAX_YS[0], OPTAX_TS[0])
    np.testing.assert_allclose(got, exp, rtol=1e-6)
    return got


def optax_batched(f, optax):
    exp = optax.softmax_cross_entropy(OPTAX_YS, jax.nn.one_hot(OPTAX_TS, 3))
    got = jax.jit(f)(OPTAX_YS, OPTAX_TS)
    np.testing.assert_allclose(got, exp, rtol=1e-6)
    return got


def optax_gradient(f, optax):
    check_grads(functools.partial(f, labels=OPTAX_TS), (OPTAX_YS,), order=1)
    gs = jax.grad(lambda x: jnp.sum(f(x, labels=OPTAX_TS, where=OPTAX_MASK)))(OPTAX_YS)
    assert jnp.all(jnp.isfinite(gs))
    return gs


def optax_per_logit_mask(f, optax):
    where = OPTAX_PER_LOGIT_MASK
    out = f(OPTAX_YS, OPTAX_TS, where=where)
    np.testing.assert_array_equal(jnp.where(jnp.any(where, -1), 0.0, out), 0)
    return out


def optax_axis(f, optax, axis, shape=(4, 5, 6)):
    rng = np.random.default_rng(axis)
    preds = rng.normal(size=shape)
    targets = rng.integers(shape[axis], size=shape[:axis] + shape[axis + 1 :])
    x = f(preds, targets, axis=axis)
    np.testing.assert_allclose(x, f(np.moveaxis(preds, axis, -1), targets), atol=1e-4)
    return x


def optax_axes(f, optax, axis, shape=(2, 3, 4, 5)):
    ndim = len(shape)
    logits_axis = tuple((x + ndim) % ndim for x in axis)
    labels_axis = tuple(x for x in range(ndim) if x not in logits_axis)
    logits_shape = tuple(shape[x] for x in logits_axis)
    labels_shape = tuple(shape[x] for x in labels_axis)
    num_classes = int(np.prod(logits_shape))
    keys = jax.random.split(jax.random.key(42), 2)
    logits = jax.random.uniform(keys[0], (*labels_shape, num_classes))
    labels = jax.random.randint(keys[1], labels_shape, 0, num_classes - 1)
    desired = f(logits, labels)
    perm_inv = tuple(np.argsort(labels_axis + logits_axis))
    logits = logits.reshape(labels_shape + logits_shape).transpose(perm_inv)
    assert logits.shape == shape
    actual = f(logits, labels, axis)
    np.testing.assert_allclose(actual, desired)
    return actual


OPTAX_AXES = [(1, 3), (3, 2), (2, 3), (-3, -1), (-1, -2), (-2, -1), (0, 1, 3), (-4, -3, -1)]
OPTAX_TESTS = [
    pytest.param(optax_scalar, {}, id="scalar"),
    pytest.param(optax_batched, {}, id="batched"),
    pytest.param(optax_gradient, {}, id="gradient"),
    pytest.param(optax_per_logit_mask, {}, id="per_logit_mask"),
    *[pytest.param(optax_axis, {"axis": a}, id=f"axis={a}") for a in range(3)],
    *[pytest.param(optax_axes, {"axis": a}, id=f"axes={a}") for a in OPTAX_AXES],
]


@pytest.mark.parametrize(("case", "kwargs"), OPTAX_TESTS)
def test_optax_alias_passes_optax_tests(case, kwargs):
    """optax's tests of softmax_cross_entropy_with_integer_labels pass with the alias in
    its place, and the alias's results are optax's."""
    optax = pytest.importorskip("optax")
    ours = case(quack_jax.softmax_cross_entropy_with_integer_labels, optax, **kwargs)
    theirs = case(optax.softmax_cross_entropy_with_integer_labels, optax, **kwargs)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


BAD_AXES = [
    ((1, 1), ValueError, "axis must name each axis once, got (1, 1)"),
    ((1, 3), ValueError, "axis 3 is out of range for an array of rank 3"),
    (-4, ValueError, "axis -4 is out of range for an array of rank 3"),
    ([1, 2], TypeError, "axis must be an int or a tuple of ints, got list"),
    ((1, "2"), TypeError, "axis must be an int or a tuple of ints, got str"),
    (1.0, TypeError, "axis must be an int or a tuple of ints, got float"),
    (None, TypeError, "axis must be an int or a tuple of ints, got NoneType"),
]


@pytest.mark.parametrize(("axis", "error", "message"), BAD_AXES, ids=[repr(b[0]) for b in BAD_AXES])
def test_optax_alias_bad_axis_names_the_argument(axis, error, message):
    alias = quack_jax.softmax_cross_entropy_with_integer_labels
    labels = jnp.zeros((2,), jnp.int32)
    with pytest.raises(error, match=re.escape(f"{alias.__name__}: {message}")):
        jax.jit(lambda x: alias(x, labels, axis)).trace(jnp.zeros((2, 3, 4)))


def reference_mean(x, labels, opts):
    """The float64 mean loss over the rows not ignored, in JAX (differentiable)."""
    loss, _ = reference_rows(x, labels, *(opts[key] for key in OPTION_KEYS))
    return jnp.sum(loss) / jnp.sum(labels != IGNORE)


OPTION_KEYS = ("label_smoothing", "z_loss", "logit_softcap")


@pytest.mark.parametrize("k", SPECIAL_OPTIONS)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("backend", backends())
def test_forward_mode(backend, dtype, k):
    """jax.jvp of the per-row losses and lse (the forward kernel and an XLA reduction of
    the tangent) and of the mean (the forward kernel that writes the gradient), jacfwd,
    and jvp of grad (a Hessian-vector product: XLA's derivative of the kernels' XLA
    references, no kernel), against float64 JAX of the reference."""
    opts = OPTIONS[k]
    logits, labels, _, _ = draw(SMALL_M, SMALL_N, dtype, "jvp", k)
    t = jax.random.normal(key_for("ce", "tangent", dtype, k), logits.shape).astype(dtype)

    def rows(x):
        return quack_jax.cross_entropy(x, labels, reduction="none", return_lse=True, **opts)

    def mean(x):
        return quack_jax.cross_entropy(x, labels, **opts)

    def f(x, t):
        return jax.jvp(rows, (x,), (t,))[1], jax.jvp(mean, (x,), (t,))[1]

    (t_loss, t_lse), t_mean = host(None, *run(backend, f, logits, t, launches=2))
    hvp = run(backend, lambda x, t: jax.jvp(jax.grad(mean), (x,), (t,))[1], logits, t, launches=0)
    jac = run(backend, jax.jacfwd(mean), logits, launches=1)
    options64 = [opts[key] for key in OPTION_KEYS]
    with jax.enable_x64(True):
        x64, t64, labels64 = (jnp.asarray(as64(a)) for a in (logits, t, labels))

        def rows64(x):
            return reference_rows(x, labels64, *options64)

        def mean64(x):
            return reference_mean(x, labels64, opts)

        (_, lse), (ref_loss, ref_lse) = jax.jvp(rows64, (x64,), (t64,))
        ref_mean = jax.jvp(mean64, (x64,), (t64,))[1]
        ref_hvp = jax.jvp(jax.grad(mean64), (x64,), (t64,))[1]
        ref_grad = jax.grad(mean64)(x64)
        lse, t64, ref_loss, ref_lse, ref_mean, ref_hvp, ref_grad = (
            np.asarray(a) for a in (lse, t64, ref_loss, ref_lse, ref_mean, ref_hvp, ref_grad)
        )
    size = np.sum(np.abs(t64), axis=-1) * (1 + 2 * opts["z_loss"] * np.abs(lse))
    tol = "float32" if dtype == "float32" else dtype
    assert_close(t_lse, ref_lse, size, tol, "lse tangent")
    assert_close(t_loss, ref_loss, size, tol, "loss tangent")
    kept = np.sum(np.asarray(labels) != IGNORE)
    assert_close(scalar(t_mean), scalar(ref_mean), scalar(np.sum(size) / kept), tol, "mean")
    assert_close(as64(jac), ref_grad, np.abs(ref_grad) + 1.0 / kept, tol, "jacfwd")
    scale = np.max(np.abs(ref_hvp)) + 1.0 / kept
    assert_close(as64(hvp), ref_hvp, np.full(ref_hvp.shape, scale), tol, "jvp of grad")


@pytest.mark.parametrize("backend", backends())
def test_implementation_xla(backend, monkeypatch):
    """implementation="xla" (and $QUACK_JAX_IMPLEMENTATION=xla): no quack_jax primitive
    in the program or its gradient, the same values; a bad value names the argument."""
    logits, labels, _, _ = draw(SMALL_M, SMALL_N, "float32", "xla")
    alias = quack_jax.softmax_cross_entropy_with_integer_labels
    fns = {
        "mean": lambda x, **kw: quack_jax.cross_entropy(x, labels, **OPTIONS[7], **kw),
        "rows": lambda x, **kw: jnp.sum(
            quack_jax.cross_entropy(x, labels, reduction="none", return_lse=True, **kw)[1]
        ),
        "optax": lambda x, **kw: jnp.sum(alias(x, jnp.maximum(labels, 0), **kw)),
    }
    for name, fn in fns.items():
        want = run(backend, jax.value_and_grad(fn), logits, launches=1 if name == "mean" else 2)
        for how in ("argument", "environment"):
            kw = {"implementation": "xla"} if how == "argument" else {}
            if how == "environment":
                monkeypatch.setenv("QUACK_JAX_IMPLEMENTATION", "xla")
            f = jax.value_and_grad(functools.partial(fn, **kw))
            jaxpr = str(jax.make_jaxpr(f)(logits))
            assert "quack_jax" not in jaxpr, f"{name}, {how}: a quack_jax primitive"
            got = run(backend, f, logits, launches=0)
            monkeypatch.delenv("QUACK_JAX_IMPLEMENTATION", raising=False)
            for a, b in zip(host(None, *got), host(None, *want), strict=True):
                assert_close(a, b, np.abs(b) + 1e-3, "float32", f"{name}, {how}")
    with pytest.raises(ValueError, match="cross_entropy: implementation must be"):
        quack_jax.cross_entropy(logits, labels, implementation="triton")


@pytest.mark.cutlass
def test_cuda_lowering_launches(monkeypatch, tmp_path):
    """Lowered for CUDA on any machine: under jax.grad a mean loss takes one kernel (the
    forward writes the gradient); per-row losses take a forward and a backward kernel;
    the loss alone one forward kernel."""
    monkeypatch.setenv("QUACK_JAX_CACHE", str(tmp_path))
    x = jax.ShapeDtypeStruct((64, 32000), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((64,), jnp.int32)

    def launches(fn):
        return lower_for_cuda(fn, (x, labels)).count("custom_call @quack_jax_launch")

    def mean_grad(x, y):
        return jax.value_and_grad(lambda x: quack_jax.cross_entropy(x, y, z_loss=1e-4))(x)

    def rows_grad(x, y):
        return jax.grad(lambda x: quack_jax.cross_entropy(x, y, reduction="none").sum())(x)

    assert launches(mean_grad) == 1
    assert launches(rows_grad) == 2
    assert launches(lambda x, y: quack_jax.cross_entropy(x, y)) == 1


def test_small_gpu_lengths_are_built():
    """The row lengths of the small tests (the optax alias's 3 classes, the label and
    axis tests' 10, SMALL_N) are among those the SPEC's lowerings build for the gpu
    tests: prebuild builds no others."""
    assert {3, 10, SMALL_N} <= gpu_lengths("cross_entropy")
