"""token_logprobs on both backends against a float64 reference (numpy, closed forms):
logp and the entropy of each row and the gradient of a weighted sum of both, across
temperatures 0.3, 1 and 2, with and without a softcap, with ignored rows, -inf logits
(masked vocabulary entries) and labels out of range; special rows (NaN, +inf, all
-inf), forward mode, the XLA formulation, cross_entropy's temperature, and
linear_token_logprobs against token_logprobs of the whole logits. What every op has (jit,
vmap, checkpoint, scan, float64, no rows and one row, bad arguments) is tested in
``test_contract.py``. Inputs are fresh random draws.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_linear_cross_entropy
from checks import SEED, assert_close, backend_param, backends, gemm_count, key_for, run

import quack_jax
from quack_jax._registry import specs

TEMPERATURES = (0.3, 1.0, 2.0)
SOFTCAPS = (None, 20.0)
IGNORE = -100
SHAPES = {
    "cpu": [(0, 7), (1, 2), (7, 1000), (5, 4097)],
    "gpu": [(0, 1000), (1, 1000), (7, 32000), (300, 50257), (64, 151936), (16, 262144)],
}
DTYPES = ("float32", "bfloat16", "float16")
CASES = [
    backend_param(backend, m, n, dtype, k)
    for backend in ("cpu", "gpu")
    for k, ((m, n), dtype) in enumerate(itertools.product(SHAPES[backend], DTYPES))
]


def options(k):
    """The k-th mix of temperature and softcap (every mix appears across the cases)."""
    temperature, softcap = list(itertools.product(TEMPERATURES, SOFTCAPS))[k % 6]
    return dict(temperature=temperature, logit_softcap=softcap)


def draw(m, n, dtype, k):
    """Logits (scale 4, a tenth of each row's columns -inf in every third row) and
    labels: a fifth ignored, some outside [0, n), some on a -inf column."""
    rng = np.random.default_rng([SEED, m, n, k])
    x = (4 * rng.standard_normal((m, n))).astype(np.float32)
    masked = rng.random((m, n)) < 0.1
    masked[1::3] = False
    x[masked] = -np.inf
    labels = rng.integers(0, n, m)
    pick = rng.random(m)
    labels[pick < 0.2] = IGNORE
    labels[(pick >= 0.2) & (pick < 0.3)] = n + 3
    labels[(pick >= 0.3) & (pick < 0.35)] = -1
    return jnp.asarray(x, dtype), jnp.asarray(labels, jnp.int32)


def reference(x, labels, g_logp, g_h, temperature, logit_softcap, ignore=IGNORE):
    """float64 logp and entropy (0 on ignored rows, logp NaN for labels outside), the
    gradient of ``sum(g_logp * logp + g_h * entropy)`` (a row whose logp is NaN and
    has a cotangent is NaN), and the magnitudes of their terms."""
    x = np.asarray(x, np.float64)
    labels = np.asarray(labels)
    n = x.shape[-1]
    capped = x if logit_softcap is None else logit_softcap * np.tanh(x / logit_softcap)
    z = capped / temperature
    top = np.max(z, axis=-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.log(np.sum(np.exp(z - top), axis=-1)) + top[:, 0]
        p = np.exp(z - lse[:, None])
        zp = np.where(p > 0, z, 0.0)
        mean = np.sum(p * zp, axis=-1)
        entropy = lse - mean
        inside = (labels >= 0) & (labels < n)
        target = np.take_along_axis(z, np.clip(labels, 0, n - 1)[:, None], -1)[:, 0]
        logp = np.where(inside, target - lse, np.nan)
        ignored = labels == ignore
        logp, entropy = (np.where(ignored, 0.0, v) for v in (logp, entropy))
        g_logp, g_h = (np.where(ignored, 0.0, g) for g in (g_logp, g_h))
        onehot = np.arange(n) == labels[:, None]
        dz = g_logp[:, None] * (onehot - p) - g_h[:, None] * p * (zp - mean[:, None])
        scale = 1.0 / temperature
        if logit_softcap is not None:
            scale = scale * (1.0 - (capped / logit_softcap) ** 2)
        grad = dz * scale
        grad = np.where((~inside & (g_logp != 0))[:, None], np.nan, grad)
        # p = exp(z - lse) carries the rounding of z - lse, relative to its size, and an
        # absolute floor: float32 exps this small may come out as 0 (the kernels flush
        # below the smallest normal; XLA's CPU exp on JAX 0.12 gave 0 for exp(-81.5),
        # 4e-36), and the gradient multiplies that error by up to |z - E| / T
        floor = 1e-30 / 2e-5
        p_mag = p * (1.0 + np.abs(np.where(p > 0, z - lse[:, None], 0.0))) + floor
        mag_grad = np.abs(g_logp)[:, None] * (onehot + p_mag) + np.abs(g_h)[:, None] * p_mag * (
            np.abs(zp) + np.abs(mean)[:, None] + 1.0
        )
        mag_grad = mag_grad * np.abs(scale)
    mag = np.abs(lse) + np.abs(mean) + 1.0
    return logp, entropy, grad, mag, mag_grad


def logprobs_and_grad(opts, ignore_index=IGNORE):
    def f(x, labels, g_logp, g_h):
        def total(x):
            logp, entropy = quack_jax.token_logprobs(
                x, labels, return_entropy=True, ignore_index=ignore_index, **opts
            )
            # rows whose logp is NaN get no cotangent where g_logp is 0
            terms = jnp.where(g_logp == 0, 0.0, g_logp * logp) + g_h * entropy
            return jnp.sum(terms), (logp, entropy)

        (_, outs), grad = jax.value_and_grad(total, has_aux=True)(x)
        return (*outs, grad)

    return f


@pytest.mark.parametrize(("backend", "m", "n", "dtype", "k"), CASES)
def test_logp_entropy_and_their_gradient(backend, m, n, dtype, k):
    opts = options(k)
    x, labels = draw(m, n, dtype, k)
    rng = np.random.default_rng([SEED, k])
    g_logp = rng.standard_normal(m).astype(np.float32)
    g_logp[rng.random(m) < 0.3] = 0.0  # some rows' logp unused: their entropy only
    g_h = rng.standard_normal(m).astype(np.float32)
    logp, entropy, grad = run(
        backend, logprobs_and_grad(opts), x, labels, g_logp, g_h, launches=2 * (m > 0)
    )
    assert logp.dtype == entropy.dtype == jnp.float32 and grad.dtype == x.dtype
    want = reference(x, labels, g_logp, g_h, **opts)
    assert_close(logp, want[0], want[3], "float32", "logp", x=x)
    assert_close(entropy, want[1], want[3], "float32", "entropy", x=x)
    assert_close(grad, want[2], want[4], dtype, "gradient", x=x)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("backend", backends())
def test_special_rows(backend, temperature):
    """A NaN logit makes the row's logp and entropy NaN, +inf its entropy NaN and its
    logp -inf (NaN at the +inf column); a row of only -inf gives NaN; -inf logits
    elsewhere count 0; without ignore_index no row is ignored (-100 is out of range)."""
    n = 1000
    x = np.asarray(np.random.default_rng(SEED).standard_normal((5, n)), np.float32)
    x[0, 3] = np.nan
    x[1, 5] = np.inf
    x[2] = -np.inf
    x[3, ::2] = -np.inf
    labels = jnp.asarray([1, 2, 3, 1, -100], jnp.int32)
    f = logprobs_and_grad(dict(temperature=temperature), ignore_index=None)
    ones = np.ones(5, np.float32)
    logp, entropy, grad = run(backend, f, jnp.asarray(x), labels, ones, ones, launches=2)
    want = reference(x, labels, ones, ones, temperature, None, ignore=None)
    assert_close(logp, want[0], want[3], "float32", "logp")
    assert_close(entropy, want[1], want[3], "float32", "entropy")
    assert np.isnan(np.asarray(logp)[[0, 2, 4]]).all() and np.asarray(logp)[1] == -np.inf
    assert np.isnan(np.asarray(entropy)[:3]).all()
    assert_close(grad[3], want[2][3], want[4][3], "float32", "gradient")


@pytest.mark.parametrize("backend", backends())
def test_forward_mode(backend):
    """jax.jvp over two leading axes, against the XLA formulation's in float64."""
    x, labels = draw(12, 1000, "float32", 0)
    x, labels = x.reshape(3, 4, 1000), labels.reshape(3, 4)

    def f(x):
        return quack_jax.token_logprobs(
            x, labels, temperature=0.7, return_entropy=True, ignore_index=IGNORE
        )

    t = jax.random.normal(jax.random.key(SEED), x.shape)
    (logp, entropy), (t_logp, t_h) = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))(x, t)
    with jax.enable_x64(True):
        x64, t64 = np.asarray(x, np.float64), np.asarray(t, np.float64)

        def g(x):
            return quack_jax.token_logprobs(
                x,
                labels,
                temperature=0.7,
                return_entropy=True,
                ignore_index=IGNORE,
                implementation="xla",
            )

        want, want_t = jax.jvp(g, (x64,), (t64,))
    for got, ref in zip((logp, entropy), want, strict=True):
        assert_close(got, ref, np.abs(ref) + 1.0, "float32", "value")
    # a NaN logp (a label outside) has a NaN tangent here, 0 in XLA's where
    for got, ref, value in zip((t_logp, t_h), want_t, want, strict=True):
        ref = np.where(np.isnan(value), np.nan, ref)
        assert_close(got, ref, np.abs(ref) + 1.0, "float32", "tangent")


@pytest.mark.parametrize("backend", backends())
def test_cross_entropy_temperature(backend):
    """cross_entropy's temperature divides the (softcapped) logits: its per-row loss is
    -token_logprobs, and the mean's gradient (from the forward kernel) matches XLA's."""
    x, labels = draw(7, 1000, "float32", 1)
    labels = jnp.where((labels != IGNORE) & ((labels < 0) | (labels >= 1000)), 5, labels)
    for temperature, cap in itertools.product(TEMPERATURES, SOFTCAPS):
        opts = dict(temperature=temperature, logit_softcap=cap)

        def mean(x, impl=None, opts=opts):
            return quack_jax.cross_entropy(x, labels, implementation=impl, **opts)

        loss = quack_jax.cross_entropy(x, labels, reduction="none", **opts)
        logp = quack_jax.token_logprobs(x, labels, ignore_index=IGNORE, **opts)
        np.testing.assert_allclose(np.asarray(loss), -np.asarray(logp), rtol=1e-6, atol=1e-6)
        value, grad = run(backend, jax.value_and_grad(mean), x, launches=1)
        with jax.enable_x64(True):
            x64 = np.asarray(x, np.float64)
            want, want_grad = jax.value_and_grad(lambda x: mean(x, "xla"))(x64)
        np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
        assert_close(grad, want_grad, np.abs(want_grad) + 1e-3, "float32", "gradient")


def test_gpu_shapes_are_built():
    """The gpu tests' row lengths and dtypes are among those the cross-entropy SPEC's
    lowerings build for them (with every softcap and entropy variant): prebuild builds
    no others."""
    tests = specs()["token_logprobs"].tests["gpu"]
    assert {n for _, n in SHAPES["gpu"]} <= set(tests.lengths)
    assert set(DTYPES) <= set(tests.dtypes)


@pytest.mark.parametrize("chunk", (128, 300))
@pytest.mark.parametrize("transpose", (False, True))
@pytest.mark.parametrize(
    ("backend", "dtype"),
    [backend_param(b, d) for b in ("cpu", "gpu") for d in ("float32", "bfloat16")],
)
def test_linear_token_logprobs_matches_the_logits(backend, dtype, transpose, chunk):
    """linear_token_logprobs in chunks (two whole and a part), or in one whose backward
    takes the forward's logits, gives token_logprobs of the whole float32 logits
    h @ W + bias (its XLA formulation), and the same gradients of h, W and the bias (to
    the rounding of the inputs' dtype)."""
    t, d, v = 300, 64, 1000
    keys = jax.random.split(key_for("linear", dtype, transpose), 4)
    h = jax.random.normal(keys[0], (t, d), dtype)
    w = (0.3 * jax.random.normal(keys[1], (v, d) if transpose else (d, v))).astype(dtype)
    bias = (0.1 * jax.random.normal(keys[2], (v,))).astype(dtype)
    labels = jax.random.randint(keys[3], (t,), 0, v).at[::7].set(IGNORE)
    opts = dict(temperature=0.7, return_entropy=True, ignore_index=IGNORE, logit_softcap=20.0)
    coords = jnp.linspace(0.5, 1.5, t)

    def total(h, w, bias, implementation=None):
        logp, ent = quack_jax.linear_token_logprobs(
            h,
            w,
            labels,
            bias=bias,
            transpose_weight=transpose,
            chunk_size=chunk,
            preferred_element_type="float32",  # bfloat16 logits would differ by ~1e-2
            precision="highest" if dtype == "float32" else None,  # the GPU's default: TF32
            implementation=implementation,
            **opts,
        )
        return jnp.sum(coords * logp - ent), (logp, ent)

    grad = jax.value_and_grad(total, argnums=(0, 1, 2), has_aux=True)
    # per vocabulary slice after the loop, and the loop's (see loop_bodies)
    slices = test_linear_cross_entropy.per_row_schedule(t, v, dict(chunk_size=chunk))
    launches = sum(test_linear_cross_entropy.loop_bodies(slices)) if backend == "gpu" else 0
    (_, outs), grads = run(backend, grad, h, w, bias, launches=launches)
    with jax.default_device(jax.devices("cpu")[0]):
        args = [np.asarray(a) for a in (h, w, bias)]
        whole = functools.partial(total, implementation="xla")  # the whole logits, in XLA
        (_, want), want_grads = jax.value_and_grad(whole, argnums=(0, 1, 2), has_aux=True)(*args)
    names = ("logp", "entropy", "dh", "dW", "db")
    for got, ref, what in zip((*outs, *grads), (*want, *want_grads), names, strict=True):
        ref = np.asarray(ref, np.float32)
        mag = np.abs(ref) + np.max(np.abs(ref))  # dh, dW: sums of terms of either sign
        assert_close(got, ref, mag, dtype if what[0] == "d" else "float32", what)


def _clipped_policy_loss(logp, entropy, advantage, old_logp, weight, kept):
    """A token's PPO/GRPO-style loss: the clipped ratio times the advantage, an entropy
    bonus, a float weight (a mean's share) and an integer mask."""
    ratio = jnp.exp(logp - old_logp)
    clipped = jnp.minimum(ratio * advantage, jnp.clip(ratio, 0.8, 1.2) * advantage)
    return jnp.where(kept > 0, -weight * (clipped + 0.01 * entropy), 0.0)


@pytest.mark.parametrize("transpose", (False, True))
@pytest.mark.parametrize(
    ("backend", "dtype"),
    [backend_param(b, d) for b in ("cpu", "gpu") for d in ("float32", "bfloat16")],
)
def test_linear_token_loss_matches_the_composition(backend, dtype, transpose):
    """linear_token_loss of a clipped policy loss, in chunks (two whole and a part), gives
    the sum of the loss over linear_token_logprobs of the whole float32 logits (its XLA
    formulation), and the same gradients of h, W, the bias and the float per-token
    arguments; it launches the forward and the backward kernel in each loop body."""
    t, d, v = 300, 64, 1000
    keys = jax.random.split(key_for("linear token loss", dtype, transpose), 6)
    h = jax.random.normal(keys[0], (t, d), dtype)
    w = (0.3 * jax.random.normal(keys[1], (v, d) if transpose else (d, v))).astype(dtype)
    bias = (0.1 * jax.random.normal(keys[2], (v,))).astype(dtype)
    labels = jax.random.randint(keys[3], (t,), 0, v).at[::7].set(IGNORE)
    advantage = jax.random.normal(keys[4], (t,))
    old_logp = jnp.log(jax.random.uniform(keys[5], (t,), minval=1e-4, maxval=2e-3))
    kept = (jnp.arange(t) % 5 != 3).astype(jnp.int32)
    weight = jnp.full((t,), 1.0 / t)
    opts = dict(temperature=0.7, ignore_index=IGNORE, logit_softcap=20.0)
    common = dict(
        bias=bias,
        transpose_weight=transpose,
        preferred_element_type="float32",
        precision="highest" if dtype == "float32" else None,
        **opts,
    )

    def fused(h, w, advantage, old_logp, weight):
        args = (advantage, old_logp, weight, kept)
        return quack_jax.linear_token_loss(
            h, w, labels, _clipped_policy_loss, *args, chunk_size=128, **common
        )

    def composed(h, w, advantage, old_logp, weight):
        logp, ent = quack_jax.linear_token_logprobs(
            h, w, labels, return_entropy=True, implementation="xla", **common
        )
        per_token = jax.vmap(_clipped_policy_loss)(logp, ent, advantage, old_logp, weight, kept)
        return jnp.sum(per_token)

    wrt = (0, 1, 2, 3, 4)
    args = (h, w, advantage, old_logp, weight)
    launches = 4 if backend == "gpu" else 0  # forward and backward, in two loop bodies
    loss, grads = run(backend, jax.value_and_grad(fused, argnums=wrt), *args, launches=launches)
    with jax.default_device(jax.devices("cpu")[0]):
        host = [np.asarray(a) for a in args]
        want, want_grads = jax.value_and_grad(composed, argnums=wrt)(*host)
    names = ("loss", "dh", "dW", "dadvantage", "dold_logp", "dweight")
    for got, ref, what in zip((loss, *grads), (want, *want_grads), names, strict=True):
        ref = np.asarray(ref, np.float32)
        mag = np.abs(ref) + np.max(np.abs(ref))
        tol = dtype if what in ("dh", "dW") else "float32"
        assert_close(got, ref, mag, tol, what)


def test_linear_token_loss_takes_three_gemms_per_chunk():
    """The token loss's gradients come from the forward pass: three GEMMs in each loop
    body (the first chunk's and the others'), where the gradient of the same loss
    through linear_token_logprobs makes each chunk's logits again (four), unless one
    chunk holds every row (three: its backward takes the forward's logits)."""
    t, d, v = 300, 16, 100
    h, w = jnp.ones((t, d)), jnp.ones((d, v))
    labels, advantage = jnp.zeros(t, jnp.int32), jnp.ones(t)

    def per_token(logp, entropy, advantage):
        return advantage * logp + 0.01 * entropy

    def fused(h, w):
        return quack_jax.linear_token_loss(h, w, labels, per_token, advantage, chunk_size=128)

    def composed(chunk):
        def loss(h, w):
            logp, ent = quack_jax.linear_token_logprobs(
                h, w, labels, return_entropy=True, chunk_size=chunk
            )
            return jnp.sum(jax.vmap(per_token)(logp, ent, advantage))

        return loss

    grads = functools.partial(jax.grad, argnums=(0, 1))
    assert gemm_count(grads(fused), h, w) == 2 * 3
    assert gemm_count(grads(composed(128)), h, w) == 2 * 4
    assert gemm_count(grads(composed(t)), h, w) == 3
    assert gemm_count(fused, h, w) == 2 * 1  # the value alone: the logits' GEMM
