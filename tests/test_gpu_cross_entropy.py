"""The cross-entropy kernels on an sm_90 GPU, against float64 references.

Every launch fills its outputs with NaN first (QUACK_JAX_POISON_OUTPUTS), so an element
a kernel fails to write shows up. Inputs are fresh random draws each run (the seed is
printed with any failure), with a fifth of the labels ignored. Where the logits are too
large for a float64 copy, the reference covers a random sample of rows and the whole
output is checked for unwritten (NaN) elements.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import SEED, assert_close, key_for, run_kernels
from shapes import CE_DTYPES, CE_ROWS, CE_VOCABS, MAX_ELEMENTS

import quack_jax

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

IGNORE = -100
OPTIONS = [
    dict(label_smoothing=s, z_loss=z, logit_softcap=c)
    for s, z, c in itertools.product((0.0, 0.1), (0.0, 1e-3), (None, 20.0))
]
SAMPLED_ROWS = 64


def cases():
    """Every (M, V, dtype) with the option mixes in turn, and every option mix at three
    vocabulary sizes (one warp per row, a cluster of odd-length rows, the largest)."""
    out = []
    for i, (m, v, dtype) in enumerate(itertools.product(CE_ROWS, CE_VOCABS, CE_DTYPES)):
        out.append((m, v, dtype, i % len(OPTIONS)))
    for v, dtype, k in itertools.product((1000, 50257, 262144), CE_DTYPES, range(len(OPTIONS))):
        if (7, v, dtype, k) not in out:
            out.append((7, v, dtype, k))
    return out


def loss_and_grad(opts):
    def f(logits, labels, g, g_lse):
        def rows(x):
            return quack_jax.cross_entropy(x, labels, reduction="none", return_lse=True, **opts)

        (loss, lse), vjp = jax.vjp(rows, logits)
        return loss, lse, vjp((g, g_lse))[0]

    return f


def reference(logits, labels, g, g_lse, opts):
    """float64 loss, lse and gradient (by autodiff), with the magnitude of each gradient
    element's terms."""
    smoothing, z_loss, cap = (opts[k] for k in ("label_smoothing", "z_loss", "logit_softcap"))
    with jax.enable_x64(True):

        def rows(x):
            if cap is not None:
                x = cap * jnp.tanh(x / cap)
            lse = jax.nn.logsumexp(x, axis=-1)
            logp = x - lse[:, None]
            nll = -jnp.take_along_axis(logp, jnp.clip(labels, 0)[:, None], -1)[:, 0]
            loss = (1 - smoothing) * nll - smoothing * jnp.mean(logp, -1) + z_loss * lse**2
            return jnp.where(labels == IGNORE, 0.0, loss), lse

        x64 = jnp.asarray(logits, jnp.float64)
        (loss, lse), vjp = jax.vjp(rows, x64)
        g64, gl64 = (jnp.asarray(a, jnp.float64) for a in (g, g_lse))
        (grad,) = vjp((g64, gl64))
        p = jnp.exp(x64 - jnp.max(x64, -1, keepdims=True))
        p = p / jnp.sum(p, -1, keepdims=True)
        scale = (jnp.abs(g64) * (1 + 2 * z_loss * jnp.abs(lse)) + jnp.abs(gl64))[:, None]
        hit = jnp.arange(x64.shape[1]) == labels[:, None]
        mag = scale * (p + jnp.max(p, -1, keepdims=True))
        mag = mag + jnp.abs(g64)[:, None] * (jnp.where(hit, 1.0, 0.0) + 1.0 / x64.shape[1])
        return loss, lse, grad, mag, jnp.abs(lse) + 1


def draw(m, v, dtype, k):
    """Logits, labels (a fifth ignored), and random cotangents of the loss and lse."""
    keys = jax.random.split(key_for("ce", m, v, dtype, k), 5)
    logits = (4.0 * jax.random.normal(keys[0], (m, v), jnp.float32)).astype(dtype)
    labels = jax.random.randint(keys[1], (m,), 0, v)
    labels = jnp.where(jax.random.uniform(keys[2], (m,)) < 0.2, IGNORE, labels)
    g = jax.random.normal(keys[3], (m,), jnp.float32)
    return logits, labels, g, jax.random.normal(keys[4], (m,), jnp.float32) * 0.1


def checked_rows(m, v):
    """All rows, or a random sample where a float64 copy of the logits would be large."""
    if m * v <= MAX_ELEMENTS // 4:
        return np.arange(m)
    return np.sort(np.random.default_rng(SEED).choice(m, SAMPLED_ROWS, replace=False))


@pytest.mark.parametrize("m,v,dtype,k", cases())
def test_per_row_losses_and_their_gradient_match_float64(m, v, dtype, k):
    """reduction="none" with lse: the forward kernel, then the backward kernel."""
    opts = OPTIONS[k]
    logits, labels, g, g_lse = draw(m, v, dtype, k)
    loss, lse, grad = run_kernels(loss_and_grad(opts), logits, labels, g, g_lse, launches=2)
    assert grad.dtype == logits.dtype and loss.dtype == jnp.float32
    assert not bool(jnp.isnan(grad).any()), f"unwritten or NaN gradient elements (seed {SEED})"
    rows = checked_rows(m, v)
    ref_loss, ref_lse, ref_grad, mag, row_mag = reference(
        logits[rows], labels[rows], g[rows], g_lse[rows], opts
    )
    assert_close(loss[rows], ref_loss, row_mag, "float32", "loss")
    assert_close(lse[rows], ref_lse, row_mag, "float32", "lse")
    assert_close(grad[rows], ref_grad, mag, dtype, "dlogits", logits=logits[rows])


def mean_or_sum(opts, reduction):
    def f(logits, labels):
        def loss(x):
            return quack_jax.cross_entropy(x, labels, reduction=reduction, **opts)

        return jax.value_and_grad(loss)(logits)

    return f


@pytest.mark.parametrize("m,v,dtype,k", cases())
def test_mean_or_sum_gradient_from_the_forward_matches_float64(m, v, dtype, k):
    """A mean (even option mixes) or sum loss under jax.grad: one forward kernel that also
    writes the gradient."""
    opts, reduction = OPTIONS[k], ("mean", "sum")[k % 2]
    logits, labels, _, _ = draw(m, v, dtype, k)
    loss, grad = run_kernels(mean_or_sum(opts, reduction), logits, labels, launches=1)
    assert grad.dtype == logits.dtype
    assert not bool(jnp.isnan(grad).any()), f"unwritten or NaN gradient elements (seed {SEED})"
    kept = labels != IGNORE
    share = 1.0 / jnp.maximum(jnp.sum(kept), 1) if reduction == "mean" else 1.0
    w = jnp.where(kept, share, 0.0).astype(jnp.float32)
    rows = checked_rows(m, v)
    ref_loss, _, ref_grad, mag, row_mag = reference(
        logits[rows], labels[rows], w[rows], jnp.zeros(len(rows), jnp.float32), opts
    )
    assert_close(grad[rows], ref_grad, mag, dtype, "dlogits", logits=logits[rows])
    if len(rows) == m and int(jnp.sum(kept)):
        with jax.enable_x64(True):
            want = jnp.sum(ref_loss * jnp.where(kept, 1.0, 0.0)) * float(share)
            size = jnp.sum(row_mag) * float(share)
        assert_close(jnp.reshape(loss, (1,)), jnp.reshape(want, (1,)), size, "float32", "loss")


@pytest.mark.parametrize("v", [7, 1000, 50257, 262144])
@pytest.mark.parametrize("dtype", CE_DTYPES)
@pytest.mark.parametrize("k", [0, 7])
def test_special_values_match_the_xla_reference(v, dtype, k):
    """NaN, +inf, all -inf rows, huge magnitudes, out-of-range and ignored labels: the
    kernels give the same NaN and inf (and values) as quack_jax's XLA reference on the CPU."""
    opts = OPTIONS[k]
    m = 12
    logits = 3.0 * jax.random.normal(key_for("special", v, dtype), (m, v), jnp.float32)
    logits = logits.at[0, v // 2].set(jnp.nan).at[1, v - 1].set(jnp.inf)
    logits = logits.at[2].set(-jnp.inf).at[3, 0].set(-jnp.inf).at[4, v // 3].set(jnp.nan)
    logits = logits.at[5, 0].set(1e30).at[5, v - 1].set(-1e30).astype(dtype)
    labels = jnp.arange(m) % v
    labels = labels.at[4].set(IGNORE).at[6].set(v).at[7].set(-1).at[8].set(IGNORE)
    g = jnp.ones((m,), jnp.float32)
    args = (logits, labels, g, jnp.zeros_like(g))
    gpu = run_kernels(loss_and_grad(opts), *args, launches=2)
    gpu += run_kernels(mean_or_sum(opts, "sum"), *args[:2], launches=1)
    cpu = jax.device_put(args, jax.devices("cpu")[0])
    ref = jax.jit(loss_and_grad(opts))(*cpu) + jax.jit(mean_or_sum(opts, "sum"))(*cpu[:2])
    names = ("loss", "lse", "dlogits", "sum", "dlogits of the sum")
    for name, out, want in zip(names, gpu, ref, strict=True):
        want = np.asarray(want, np.float64)
        out = np.asarray(jax.device_get(out), np.float64)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(want), err_msg=name)
        np.testing.assert_array_equal(np.isinf(out), np.isinf(want), err_msg=name)
        finite = np.isfinite(want)
        tol = 1e-2 if dtype == "bfloat16" and name.startswith("dlogits") else 1e-5
        np.testing.assert_allclose(out[finite], want[finite], rtol=tol, atol=tol, err_msg=name)
    assert (np.asarray(gpu[4])[[4, 8]] == 0).all()


def prebuild_cases():
    """(fn, shape-dtype structs) for everything these tests run through kernels."""
    for m, v, dtype, k in cases():
        yield loss_and_grad(OPTIONS[k]), _specs(m, v, dtype)
        yield mean_or_sum(OPTIONS[k], ("mean", "sum")[k % 2]), _specs(m, v, dtype)[:2]
    for v, dtype, k in itertools.product([7, 1000, 50257, 262144], CE_DTYPES, [0, 7]):
        yield loss_and_grad(OPTIONS[k]), _specs(12, v, dtype)
        yield mean_or_sum(OPTIONS[k], "sum"), _specs(12, v, dtype)[:2]


def _specs(m, v, dtype):
    row = jax.ShapeDtypeStruct((m,), jnp.float32)
    return jax.ShapeDtypeStruct((m, v), dtype), jax.ShapeDtypeStruct((m,), jnp.int32), row, row
