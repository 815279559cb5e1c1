"""linear_cross_entropy on an sm_90 GPU, against float64 references of
``cross_entropy(h @ W + bias)`` on fresh inputs (the seed is printed with any failure).

Every kernel launch fills its outputs with NaN first (QUACK_JAX_POISON_OUTPUTS), except
the gradient written over the logits in place, which is the logits' own buffer. The
reference rounds the logits as the GEMM does (to bfloat16 for bfloat16 inputs; float32
runs its GEMMs at precision "highest") and the gradient of the logits as the kernel
does, so what is compared is the chunking, the kernels and the gradient GEMMs; the
bounds allow for a logit the GEMM rounds the other way (see ``reference``). The
in-place test checks the compiled program: the launch aliases the logits, no second
(chunk, V) buffer, no transposed copy of a (V, d) weight.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import TOL, assert_close, key_for

import quack_jax
from quack_jax import _ffi

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

IGNORE = -100
VOCABS = (32000, 50257, 128256, 152064, 256000)
DTYPES = ("bfloat16", "float32")
T, D, CHUNK = 300, 64, 128  # two whole chunks and a part
# (reduction, options, bias, transposed weight), in turn over the cases
MIXES = [
    ("mean", {}, False, False),
    ("none", dict(label_smoothing=0.1, return_lse=True), True, False),
    ("sum", dict(z_loss=1e-3, logit_softcap=20.0), False, True),
    ("none", dict(logit_softcap=30.0, z_loss=1e-4), True, True),
    ("mean", dict(label_smoothing=0.05, z_loss=1e-4), True, False),
]


def cases():
    return [
        (v, dtype, i % len(MIXES)) for i, (v, dtype) in enumerate(itertools.product(VOCABS, DTYPES))
    ]


def draw(t, d, v, dtype, k, transpose):
    """h, the weight (logits of about unit size), a bias, labels (a fifth ignored), and
    cotangents of the per-row loss and lse."""
    keys = jax.random.split(key_for("lce", t, d, v, dtype, k), 6)
    h = jax.random.normal(keys[0], (t, d), jnp.float32).astype(dtype)
    w = (2.0 / np.sqrt(d)) * jax.random.normal(keys[1], (v, d) if transpose else (d, v))
    bias = 0.5 * jax.random.normal(keys[2], (v,))
    labels = jax.random.randint(keys[3], (t,), 0, v)
    labels = jnp.where(jax.random.uniform(keys[4], (t,)) < 0.2, IGNORE, labels)
    g = jax.random.normal(keys[5], (2, t), jnp.float32)
    return h, w.astype(dtype), bias.astype(dtype), labels, g[0], 0.1 * g[1]


def function(reduction, opts, transpose, precision, chunk=CHUNK):
    """(h, w, bias, labels, g, g_lse) -> (loss, dh, dw, db) of linear_cross_entropy; per-row
    losses (and lse) are weighted by the cotangents."""

    def loss(h, w, bias, labels, g, g_lse):
        out = quack_jax.linear_cross_entropy(
            h,
            w,
            labels,
            bias=bias,
            transpose_weight=transpose,
            reduction=reduction,
            chunk_size=chunk,
            precision=precision,
            **opts,
        )
        loss, lse = out if opts.get("return_lse") else (out, None)
        extra = 0.0 if lse is None else jnp.sum(lse * g_lse)
        return (jnp.sum(loss * g) if reduction == "none" else loss) + extra

    def f(h, w, bias, labels, g, g_lse):
        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(h, w, bias, labels, g, g_lse)
        return value, *grads

    return f


def reference(h, w, bias, labels, g, g_lse, reduction, opts, transpose, dtype):
    """float64 value and gradients, with the magnitude of each result's terms."""
    smoothing, z_loss, cap = (
        opts.get(k, 0.0) for k in ("label_smoothing", "z_loss", "logit_softcap")
    )
    with jax.enable_x64(True):
        h64, w64, b64 = (jnp.asarray(a, jnp.float64) for a in (h, w, bias))
        w64 = w64.T if transpose else w64
        z = (h64 @ w64).astype(dtype).astype(jnp.float64) + b64
        z = z.astype(dtype).astype(jnp.float64)

        def per_row(z):
            x = cap * jnp.tanh(z / cap) if cap else z
            lse = jax.nn.logsumexp(x, axis=-1)
            logp = x - lse[:, None]
            nll = -jnp.take_along_axis(logp, jnp.clip(labels, 0)[:, None], -1)[:, 0]
            loss = (1 - smoothing) * nll - smoothing * jnp.mean(logp, -1) + z_loss * lse**2
            return jnp.where(labels == IGNORE, 0.0, loss), lse

        kept = jnp.sum(labels != IGNORE)
        share = g if reduction == "none" else 1.0 / kept if reduction == "mean" else 1.0
        g_lse = g_lse if opts.get("return_lse") else 0.0

        def total(z):
            loss, lse = per_row(z)
            return jnp.sum(loss * share) + jnp.sum(lse * g_lse)

        value, dz = jax.value_and_grad(total)(z)
        # The GEMM may round a logit the other way (its sum in another order, or the bias
        # added before rounding): one ulp, u, at most. To first order that moves the value
        # by sum(|dz| u) and the row's softmax p by p (u + sum(p u)).
        u = jnp.abs(z) * float(jnp.finfo(dtype).eps)
        x = cap * jnp.tanh(z / cap) if cap else z
        p = jnp.exp(x - jax.nn.logsumexp(x, axis=-1, keepdims=True))
        coef = (jnp.abs(share) + jnp.abs(g_lse)) * (1 + 2 * z_loss * jnp.abs(per_row(z)[1]))
        moved = jnp.reshape(coef, (-1, 1)) * p * (u + jnp.sum(p * u, -1, keepdims=True))
        dz = dz.astype(dtype).astype(jnp.float64)  # the kernel writes dlogits in h's dtype
        dh, dw, db = dz @ w64.T, h64.T @ dz, jnp.sum(dz, 0)
        adz = jnp.abs(dz) + moved / TOL[dtype]
        lse = jnp.abs(per_row(z)[1])
        mags = (
            jnp.sum((lse + 1) * jnp.abs(share))
            + jnp.sum(lse * jnp.abs(g_lse))
            + jnp.sum(jnp.abs(dz) * u) / TOL["float32"],
            adz @ jnp.abs(w64).T,
            (jnp.abs(h64).T @ adz).T if transpose else jnp.abs(h64).T @ adz,
            adz.sum(0),
        )
        return (value, dh, dw.T if transpose else dw, db), mags


@pytest.mark.parametrize("v,dtype,k", cases())
def test_loss_and_gradients_match_float64(v, dtype, k):
    reduction, opts, with_bias, transpose = MIXES[k]
    h, w, bias, labels, g, g_lse = draw(T, D, v, dtype, k, transpose)
    precision = "highest" if dtype == "float32" else None
    f = jax.jit(function(reduction, opts, transpose, precision))
    lowered = f.lower(h, w, bias if with_bias else None, labels, g, g_lse)
    assert f"custom_call @{_ffi.TARGET}" in lowered.as_text()
    outs = lowered.compile()(h, w, bias if with_bias else None, labels, g, g_lse)
    refs, mags = reference(
        h,
        w,
        bias if with_bias else jnp.zeros_like(bias),
        labels,
        g,
        g_lse,
        reduction,
        opts,
        transpose,
        dtype,
    )
    names = ("loss", "dh", "dw", "db")
    for name, out, ref, mag in zip(names, outs, refs, mags, strict=True):
        if out is None:
            continue
        assert out.dtype == (jnp.float32 if name == "loss" else h.dtype), name
        shape = jnp.shape(ref) or (1,)
        assert_close(
            jnp.reshape(out, shape),
            jnp.reshape(ref, shape),
            jnp.reshape(mag, shape),
            dtype if name != "loss" else "float32",
            name,
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose", [False, True])
def test_logits_are_overwritten_in_place(dtype, transpose):
    """The compiled value_and_grad aliases the gradient kernel's output to its logits, holds
    no second (chunk, V) buffer, and makes no transposed copy of the weight."""
    t, d, v, chunk = 4096, 256, 128256, 1024
    e = np.dtype(dtype).itemsize
    h = jax.ShapeDtypeStruct((t, d), dtype)
    w = jax.ShapeDtypeStruct((v, d) if transpose else (d, v), dtype)
    labels = jax.ShapeDtypeStruct((t,), jnp.int32)

    def loss(h, w, labels):
        return quack_jax.linear_cross_entropy(
            h, w, labels, transpose_weight=transpose, chunk_size=chunk
        )

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w, labels).compile()
    text = compiled.as_text()
    launches = [line for line in text.splitlines() if f'custom_call_target="{_ffi.TARGET}"' in line]
    assert launches and all("output_to_operand_aliasing={{2}: (0, {})}" in x for x in launches)
    chunk_bytes, dw_bytes, dh_bytes = chunk * v * e, d * v * 4, t * d * e
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < dw_bytes + dh_bytes + 1.5 * chunk_bytes, (temp, chunk_bytes, dw_bytes)
    for op in ("transpose", "copy"):
        for shape in (f"[{v},{d}]", f"[{d},{v}]"):
            pattern = rf"{'bf16' if dtype == 'bfloat16' else 'f32'}{re.escape(shape)}\S* {op}\("
            assert not re.search(pattern, text), f"a {op} of the weight: {pattern}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_match_the_xla_reference(dtype):
    """NaN and inf in h, labels out of range, an all-ignored chunk (rows 16-31, chunks of
    16): the same NaN and inf as the XLA reference on the CPU, values close."""
    t, d, v = 40, 32, 50257
    h, w, _, labels, g, g_lse = draw(t, d, v, dtype, 99, False)
    h = h.at[1, 3].set(jnp.nan).at[2, 0].set(jnp.inf).at[5].set(0.0)
    labels = labels.at[3].set(v).at[4].set(-1).at[16:32].set(IGNORE)
    results = []
    for reduction, opts in (("none", dict(return_lse=True)), ("sum", {})):
        f = function(reduction, opts, False, "highest" if dtype == "float32" else None, 16)
        args = (h, w, None, labels, g, g_lse)
        gpu = jax.jit(f)(*args)
        cpu = jax.jit(f)(*jax.device_put(args, jax.devices("cpu")[0]))
        results += list(zip(gpu, cpu, strict=True))
    for i, (out, want) in enumerate(results):
        if out is None:
            continue
        out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(want), err_msg=f"result {i}")
        np.testing.assert_array_equal(np.isinf(out), np.isinf(want), err_msg=f"result {i}")
        finite = np.isfinite(want)
        tol = 5 * TOL[dtype]
        np.testing.assert_allclose(
            out[finite], want[finite], rtol=tol, atol=tol, err_msg=f"result {i}"
        )


def prebuild_cases():
    """(fn, shape-dtype structs) for everything these tests run through kernels."""
    for v, dtype, k in cases():
        reduction, opts, with_bias, transpose = MIXES[k]
        h, w, bias, *rest = _specs(T, D, v, dtype, transpose)
        yield function(reduction, opts, transpose, None), (h, w, bias if with_bias else None, *rest)
    for dtype in DTYPES:
        h, w, _, *rest = _specs(40, 32, 50257, dtype, False)
        for reduction, opts in (("none", dict(return_lse=True)), ("sum", {})):
            yield function(reduction, opts, False, None), (h, w, None, *rest)


def _specs(t, d, v, dtype, transpose):
    row = jax.ShapeDtypeStruct((t,), jnp.float32)
    return (
        jax.ShapeDtypeStruct((t, d), dtype),
        jax.ShapeDtypeStruct((v, d) if transpose else (d, v), dtype),
        jax.ShapeDtypeStruct((v,), dtype),
        jax.ShapeDtypeStruct((t,), jnp.int32),
        row,
        row,
    )
