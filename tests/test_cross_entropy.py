"""quack_jax.cross_entropy through the XLA fallback (CPU), against float64 references
written here with ``jax.nn``, their gradients by JAX's own autodiff."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quack_jax
from quack_jax.build import lower_for_cuda

TOL = {"float32": 2e-5, "bfloat16": 1e-2, "float16": 2e-3}
IGNORE = -100


def reference_rows(logits, labels, smoothing=0.0, z_loss=0.0, softcap=None, ignore=IGNORE):
    """float64 per-row loss and lse; ignored rows 0 (by ``where``, so their gradient is 0)."""
    x = logits.astype(jnp.float64)
    if softcap is not None:
        x = softcap * jnp.tanh(x / softcap)
    lse = jax.nn.logsumexp(x, axis=-1)
    logp = x - lse[..., None]
    n = x.shape[-1]
    nll = -jnp.take_along_axis(logp, jnp.clip(labels, 0, n - 1)[..., None], -1)[..., 0]
    loss = (1 - smoothing) * nll
    if smoothing:  # terms added only when asked for, so 0 * inf does not make a NaN
        loss = loss - smoothing * jnp.mean(logp, axis=-1)
    if z_loss:
        loss = loss + z_loss * lse**2
    return jnp.where(labels == ignore, 0.0, loss), lse


def make_inputs(m, n, dtype, seed=0, ignored=0.25):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    logits = (3.0 * jax.random.normal(k1, (m, n), jnp.float32)).astype(dtype)
    labels = jax.random.randint(k2, (m,), 0, n)
    labels = jnp.where(jax.random.uniform(k3, (m,)) < ignored, IGNORE, labels)
    return logits, labels


def close(out, ref, dtype, scale=1.0):
    np.testing.assert_allclose(
        np.asarray(out, np.float64), np.asarray(ref), rtol=TOL[dtype], atol=TOL[dtype] * scale
    )


OPTIONS = [
    dict(smoothing=s, z_loss=z, softcap=c)
    for s, z, c in itertools.product((0.0, 0.1), (0.0, 1e-3), (None, 5.0))
]


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_loss_and_gradient_match_float64(opts, dtype, reduction):
    logits, labels = make_inputs(37, 1000, dtype, seed=hash(str(opts)) % 1000)
    kwargs = dict(
        label_smoothing=opts["smoothing"], z_loss=opts["z_loss"], logit_softcap=opts["softcap"]
    )
    weights = jax.random.normal(jax.random.key(7), (37,))

    def ours(x):
        loss = quack_jax.cross_entropy(x, labels, reduction=reduction, **kwargs)
        return jnp.sum(loss * weights) if reduction == "none" else loss

    def ref(x):
        rows, _ = reference_rows(x, labels, **opts)
        if reduction == "none":
            return jnp.sum(rows * weights)
        total = jnp.sum(rows)
        return total if reduction == "sum" else total / jnp.sum(labels != IGNORE)

    loss, grad = jax.value_and_grad(ours)(logits)
    assert loss.dtype == jnp.float32 and grad.dtype == logits.dtype
    with jax.enable_x64(True):
        x64 = jnp.asarray(logits, jnp.float64)
        ref_loss, ref_grad = jax.value_and_grad(ref)(x64)
    close(loss, ref_loss, dtype, scale=float(jnp.abs(ref_loss)) + 1)
    close(grad.astype(jnp.float32), ref_grad, dtype, scale=float(jnp.max(jnp.abs(ref_grad))))
    ignored = np.asarray(labels == IGNORE)
    assert np.all(np.asarray(grad)[ignored] == 0)


def test_per_row_loss_lse_and_lse_gradient():
    logits, labels = make_inputs(16, 257, "float32", seed=3)
    loss, lse = quack_jax.cross_entropy(logits, labels, reduction="none", return_lse=True)
    with jax.enable_x64(True):
        ref_loss, ref_lse = reference_rows(jnp.asarray(logits, jnp.float64), labels)
    close(loss, ref_loss, "float32", 10.0)
    close(lse, ref_lse, "float32", 10.0)

    def f(x):
        loss, lse = quack_jax.cross_entropy(x, labels, return_lse=True, z_loss=0.01)
        return loss + jnp.sum(jnp.sin(lse))

    def g(x):
        rows, lse = reference_rows(x, labels, z_loss=0.01)
        return jnp.sum(rows) / jnp.sum(labels != IGNORE) + jnp.sum(jnp.sin(lse))

    with jax.enable_x64(True):
        ref = jax.grad(g)(jnp.asarray(logits, jnp.float64))
    close(jax.grad(f)(logits), ref, "float32", 1.0)


def test_leading_dims_vmap_and_jit():
    logits, labels = make_inputs(24, 100, "float32", seed=5)
    x3, l3 = logits.reshape(2, 3, 4, 100), labels.reshape(2, 3, 4)
    flat = quack_jax.cross_entropy(logits, labels, reduction="none")
    np.testing.assert_array_equal(
        quack_jax.cross_entropy(x3, l3, reduction="none"), flat.reshape(2, 3, 4)
    )
    batched = jax.jit(jax.vmap(lambda x, y: quack_jax.cross_entropy(x, y, reduction="none")))(
        x3, l3
    )
    np.testing.assert_array_equal(batched, flat.reshape(2, 3, 4))
    grads = jax.vmap(jax.grad(lambda x, y: quack_jax.cross_entropy(x, y, reduction="sum")))(x3, l3)
    flat_grad = jax.grad(lambda x: quack_jax.cross_entropy(x, labels, reduction="sum"))(logits)
    np.testing.assert_allclose(grads.reshape(24, 100), flat_grad, rtol=1e-6, atol=1e-7)


def test_special_values_and_labels():
    n = 6
    logits = jnp.array(
        [
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],  # label out of range -> NaN
            [0.0, jnp.nan, 2.0, 3.0, 4.0, 5.0],  # NaN logit -> NaN
            [0.0, jnp.inf, 2.0, 3.0, 4.0, 5.0],  # +inf -> lse +inf, loss +inf
            [-jnp.inf] * 6,  # all -inf -> NaN
            [0.0, jnp.nan, 2.0, 3.0, 4.0, 5.0],  # ignored NaN row -> 0, gradient 0
            [1e30, 1.0, -1e30, 3.0, 4.0, 5.0],  # huge magnitudes
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],  # negative label -> NaN
        ],
        jnp.float32,
    )
    labels = jnp.array([n, 0, 0, 0, IGNORE, 1, -1])
    loss, lse = quack_jax.cross_entropy(logits, labels, reduction="none", return_lse=True)
    loss, lse = np.asarray(loss), np.asarray(lse)
    assert np.isnan(loss[[0, 1, 3, 6]]).all()
    assert loss[2] == np.inf and lse[2] == np.inf
    assert lse[3] == -np.inf and np.isnan(lse[1])
    assert loss[4] == 0.0
    np.testing.assert_allclose(loss[5], 1e30 - 1.0, rtol=1e-6)
    grad = np.asarray(
        jax.grad(lambda x: quack_jax.cross_entropy(x, labels, reduction="sum"))(logits)
    )
    assert np.isnan(grad[[0, 6]]).all()
    assert (grad[4] == 0).all()
    assert np.isfinite(grad[5]).all()


def test_mean_counts_rows_not_ignored_and_empty_inputs():
    logits, labels = make_inputs(8, 10, "float32", seed=1, ignored=0.0)
    labels = labels.at[:3].set(IGNORE)
    mean = quack_jax.cross_entropy(logits, labels)
    total = quack_jax.cross_entropy(logits, labels, reduction="sum")
    np.testing.assert_allclose(mean, total / 5, rtol=1e-6)
    assert np.isnan(quack_jax.cross_entropy(logits, jnp.full((8,), IGNORE)))
    empty = quack_jax.cross_entropy(
        jnp.zeros((0, 10)), jnp.zeros((0,), jnp.int32), reduction="none"
    )
    assert empty.shape == (0,)
    assert (
        quack_jax.cross_entropy(jnp.zeros((0, 10)), jnp.zeros((0,), jnp.int32), reduction="sum")
        == 0
    )
    out = quack_jax.cross_entropy(logits.astype(jnp.float16), labels.astype(jnp.int16))
    np.testing.assert_allclose(out, mean, rtol=2e-3)
    unsigned = jnp.array([0, 3, 2**32 - 1], jnp.uint32)  # the last is out of range, not -1
    rows = quack_jax.cross_entropy(logits[:3], unsigned, reduction="none")
    assert np.isfinite(rows[:2]).all() and np.isnan(rows[2])


def test_float64_runs_the_reference():
    with jax.enable_x64(True):
        logits, labels = make_inputs(5, 9, "float64", seed=2)
        labels = labels.astype(jnp.int64)
        out = quack_jax.cross_entropy(logits, labels, reduction="none", label_smoothing=0.2)
        ref, _ = reference_rows(logits, labels, smoothing=0.2)
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, ref, rtol=1e-12)
        big = labels.at[0].set(2**32 + 1)  # beyond int32: out of range, not wrapped
        assert np.isnan(quack_jax.cross_entropy(logits, big, reduction="none")[0])


def test_optax_alias_matches_optax():
    optax = pytest.importorskip("optax")
    logits, labels = make_inputs(12, 50, "float32", seed=4, ignored=0.0)
    labels = labels.at[0].set(-1).at[1].set(-50).at[2].set(50).at[3].set(-51)
    ours = quack_jax.softmax_cross_entropy_with_integer_labels(logits, labels)
    theirs = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    assert np.isnan(ours[2]) and np.isnan(ours[3]) and np.isfinite(ours[:2]).all()
    grad_ours = jax.grad(
        lambda x: quack_jax.softmax_cross_entropy_with_integer_labels(x, labels)[4:].sum()
    )(logits)
    grad_theirs = jax.grad(
        lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels)[4:].sum()
    )(logits)
    np.testing.assert_allclose(grad_ours, grad_theirs, rtol=1e-5, atol=1e-6)
    t = jnp.moveaxis(logits, -1, 0)
    np.testing.assert_allclose(
        quack_jax.softmax_cross_entropy_with_integer_labels(t, labels, axis=0), theirs, rtol=1e-5
    )
    rows = jnp.arange(12) % 3 > 0
    np.testing.assert_allclose(
        quack_jax.softmax_cross_entropy_with_integer_labels(logits, labels, where=rows),
        optax.softmax_cross_entropy_with_integer_labels(logits, labels, where=rows),
        rtol=1e-5,
    )
    mask = jax.random.uniform(jax.random.key(1), logits.shape) > 0.3
    ok = labels >= 0
    np.testing.assert_allclose(
        quack_jax.softmax_cross_entropy_with_integer_labels(logits[ok], labels[ok], where=mask[ok]),
        optax.softmax_cross_entropy_with_integer_labels(logits[ok], labels[ok], where=mask[ok]),
        rtol=1e-5,
    )


BAD = [
    (dict(labels=jnp.zeros((4,), jnp.float32)), TypeError, "labels must have an integer dtype"),
    (
        dict(labels=jnp.zeros((5,), jnp.int32)),
        ValueError,
        "labels must have the logits' leading shape",
    ),
    (dict(labels=[0, 1, 2, 3]), TypeError, "labels must be an integer array"),
    (dict(logits=jnp.zeros((4, 8), jnp.int32)), TypeError, "logits must have a floating dtype"),
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
    (dict(label_smoothing=1.0), ValueError, "label_smoothing must be in"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing must be in"),
    (dict(label_smoothing=jnp.float32(0.1)), TypeError, "label_smoothing must be a Python float"),
    (dict(z_loss=-1.0), ValueError, "z_loss must be"),
    (dict(logit_softcap=0.0), ValueError, "logit_softcap must be positive"),
    (dict(logit_softcap=float("inf")), ValueError, "logit_softcap must be"),
    (dict(ignore_index=1.5), TypeError, "ignore_index must be a Python int"),
    (dict(ignore_index=2**40), ValueError, "ignore_index must fit in int32"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool"),
]


@pytest.mark.parametrize("change,error,message", BAD)
def test_bad_inputs_name_the_argument(change, error, message):
    args = dict(logits=jnp.zeros((4, 8)), labels=jnp.zeros((4,), jnp.int32))
    args.update(change)
    logits, labels = args.pop("logits"), args.pop("labels")
    with pytest.raises(error, match=message):
        jax.jit(lambda x: quack_jax.cross_entropy(x, labels, **args)).trace(logits)


@pytest.mark.cutlass
def test_cuda_lowering_launches(monkeypatch, tmp_path):
    """Under jax.grad a mean loss takes one kernel (the forward writes the gradient); per-row
    losses take a forward and a backward kernel; the loss alone one forward kernel."""
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
