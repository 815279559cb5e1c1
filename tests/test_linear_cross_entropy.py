"""quack_jax.linear_cross_entropy on both backends: ``cross_entropy(h @ weight + bias)``
in chunks of rows, its values and the gradients of h, the weight and the bias against
one float64 reference (``reference``), which rounds the logits as the GEMM makes them.

1. the test grid (SPEC), every option (reductions, label smoothing, z-loss, softcap,
   lse with a cotangent of its own, ignore_index, bias, both weight layouts) in float32
   and bfloat16;
2. chunk sizes that divide T or not, larger than T, 1;
3. an ignored chunk, every row ignored, labels out of range, NaN and inf in h;
4. memory: less than the unfused loss by the logits; on the GPU the kernel writes the
   gradient over the logits in place; dW summed over the chunks in its GEMM's output;
5. the gradient of h alone or of the weight alone, and that only it is made;
6. preferred_element_type and precision, implementation="xla".

What every op has (jit, vmap, checkpoint, scan, float64 with x64 on, no rows and one row,
bad arguments) is tested in ``test_contract.py``, sharding in ``test_sharding.py``.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import (
    TOL,
    assert_close,
    backends,
    gemm_count,
    gpu_lengths,
    grid,
    key_for,
    run,
    run_launching,
)

import quack_jax
from quack_jax import _ffi
from quack_jax.linear_cross_entropy import options as linear_options
from quack_jax.linear_cross_entropy import spec as lce_spec
from quack_jax.linear_cross_entropy.options import LinearOptions, Slices

IGNORE = -100
D, CHUNK = 64, 128  # the grid's hidden size and chunk: T = 300 is two whole chunks and a part
T, HIDDEN, V = 37, 16, 1000  # the smaller cases' tokens, hidden size and vocabulary
SCALE = 1.5  # the cotangent of a "sum" or "mean" loss: not 1, so custom_vjp must scale
ALL = ("h", "weight", "bias")


def draw(
    t=T,
    d=HIDDEN,
    v=V,
    dtype="float32",
    *,
    transpose=False,
    ignored=0.2,
    ignore_index=IGNORE,
    tag=(),
):
    """h (t, d); a weight (d, v), or (v, d) with ``transpose``, giving logits of about unit
    size; a bias; labels with about a fraction ``ignored`` of them ``ignore_index`` (with
    ``ignored`` and two rows or more: the first row, and never the second); the
    cotangents of the per-row losses and of lse."""
    keys = jax.random.split(key_for("lce", t, d, v, dtype, transpose, *tag), 6)
    h = jax.random.normal(keys[0], (t, d), jnp.float32)
    w = (2.0 / np.sqrt(d)) * jax.random.normal(keys[1], (v, d) if transpose else (d, v))
    bias = 0.5 * jax.random.normal(keys[2], (v,))
    labels = jax.random.randint(keys[3], (t,), 0, v)
    labels = jnp.where(jax.random.uniform(keys[4], (t,)) < ignored, ignore_index, labels)
    if ignored and t >= 2:  # both kinds of row, whatever the draw
        labels = labels.at[0].set(ignore_index).at[1].set((ignore_index + 1) % v)
    g = jax.random.normal(keys[5], (2, t), jnp.float32)
    return h.astype(dtype), w.astype(dtype), bias.astype(dtype), labels, g[0], 0.1 * g[1]


def loss_and_grads(wrt=ALL, **opts):
    """(h, w, bias, labels, g, g_lse) -> (out, grads): linear_cross_entropy with ``opts``,
    and the gradients (a dict) of the arguments in ``wrt`` for the cotangents g of the
    per-row losses (SCALE of a "sum" or "mean") and g_lse of lse. float32 GEMMs run at
    precision "highest" unless ``opts`` say (the GPU's default is TF32)."""
    per_row = opts.get("reduction", "mean") == "none"
    with_lse = opts.get("return_lse", False)

    def f(h, w, bias, labels, g, g_lse):
        given = dict(h=h, weight=w, bias=bias)
        precision = opts.get("precision", "highest" if h.dtype == jnp.float32 else None)

        def op(*args):
            x = given | dict(zip(wrt, args, strict=True))
            return quack_jax.linear_cross_entropy(
                x["h"], x["weight"], labels, bias=x["bias"], **{**opts, "precision": precision}
            )

        out, vjp = jax.vjp(op, *(given[k] for k in wrt))
        loss = out[0] if with_lse else out
        ct = (g if per_row else jnp.full_like(loss, SCALE)).astype(loss.dtype)
        grads = vjp((ct, g_lse.astype(loss.dtype)) if with_lse else ct)
        return out, dict(zip(wrt, grads, strict=True))

    return f


def per_row_schedule(t, v, opts):
    """The vocabulary slices per-row losses (or lse) of ``opts`` take on t rows (and
    their kept count), or None where they go in chunks of rows."""
    linear = LinearOptions(False, opts.get("chunk_size") or max(t, 1), "float32")
    return linear.slices(t, v, keep=True)


def per_row(opts):
    return opts.get("reduction", "mean") == "none" or opts.get("return_lse")


def loop_bodies(slices):
    """(forward, backward) bodies over ``slices``, each run once: the loop over the
    slices but the last max(kept, 1) (one body, if any), and each of those."""
    n, kept = len(slices.widths), slices.kept
    looped = n - max(kept, 1)
    forward = (looped > 0) + n - looped
    return forward, kept + (looped > 0) + n - looped - kept


def launches(t, opts, v=V):
    """The kernels loss_and_grads launches on t rows: a pass over the chunks launches one
    for the first chunk and one in the loop over the others; a "sum" or "mean" loss takes
    one pass (its gradients come from the forward), per-row losses (or lse) two, or one
    for each of their slices' ``loop_bodies``."""
    chunks = -(-t // (opts.get("chunk_size") or max(t, 1)))
    if not per_row(opts):
        return min(chunks, 2)
    slices = per_row_schedule(t, v, opts)
    return sum(loop_bodies(slices)) if slices else 2 * min(chunks, 2)


def reference(h, w, bias, labels, g, g_lse, opts, logits_dtype=None):
    """float64 (out, grads) as loss_and_grads gives them (numpy), and the magnitude of the
    terms of each result (a dict: loss, lse, h, weight, bias).

    The logits are rounded as the GEMM makes them, to ``logits_dtype`` (h's by default),
    after the bias too; the gradient of the logits is rounded to h's dtype, as the op
    hands it to the backward GEMMs. Where the GEMM rounds a logit the other way (one
    unit, u), a result moves by its derivative times u, and where the op rounds a
    gradient of a logit the other way, the gradients move by one unit of it times h or
    the weight: the magnitudes allow for both.
    As in cross_entropy: an ignored row's loss is 0, a label outside [0, V) gives a NaN
    loss and, where its loss has a cotangent, a NaN gradient row; a row whose loss and
    lse have no cotangent has no gradient (whatever its logits)."""
    dtype, zdtype = np.dtype(h.dtype), np.dtype(logits_dtype or h.dtype)
    loss_tol = TOL["float64" if zdtype == np.float64 else "float32"]
    reduction, with_lse = opts.get("reduction", "mean"), opts.get("return_lse", False)
    s, zl, cap = (opts.get(k) or 0.0 for k in ("label_smoothing", "z_loss", "logit_softcap"))
    transpose, lead = opts.get("transpose_weight", False), np.shape(labels)

    def f64(a):
        return np.asarray(a, np.float64)

    def rounded(x, d):
        return x.astype(d).astype(np.float64)

    with np.errstate(all="ignore"):
        h64 = f64(h).reshape(-1, h.shape[-1])
        wt = f64(w).T if transpose else f64(w)  # (d, V)
        y = np.asarray(labels).reshape(-1)
        z = rounded(h64 @ wt, zdtype)
        if bias is not None:
            z = rounded(z + f64(bias), zdtype)
        v = z.shape[-1]
        ignored = y == opts.get("ignore_index", IGNORE)
        outside = ~ignored & ((y < 0) | (y >= v))
        share = 1.0 / np.sum(~ignored) if reduction == "mean" else 1.0
        gl = f64(g).reshape(-1) if reduction == "none" else np.full(y.shape, SCALE * share)
        gl = np.where(ignored, 0.0, gl)  # the cotangents of the rows' losses and lse
        gs = f64(g_lse).reshape(-1) if with_lse else np.zeros(y.shape)

        x = cap * np.tanh(z / cap) if cap else z
        top = np.max(x, -1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        lse = np.log(np.sum(np.exp(x - top), -1)) + top[:, 0]
        p = np.exp(x - lse[:, None])
        hit = np.arange(v) == y[:, None]
        target = np.sum(np.where(hit, x, 0.0), -1)
        loss = lse - (1 - s) * target
        if s:
            loss = loss - s * np.mean(x, -1)
        if zl:
            loss = loss + zl * lse**2
        loss = np.where(ignored, 0.0, np.where(outside, np.nan, loss))

        # the gradient of sum(gl * loss + gs * lse) with respect to the logits
        a = gs + np.where(gl == 0, 0.0, gl * (1 + 2 * zl * lse))
        slope = 1 - (x / cap) ** 2 if cap else 1.0
        dz_capped = a[:, None] * p - (gl * (1 - s))[:, None] * hit - (gl * s / v)[:, None]
        dz = dz_capped * slope
        dz[(gl == 0) & (gs == 0)] = 0.0
        dz[outside & (gl != 0)] = np.nan
        dz = rounded(dz, dtype)
        value = loss.reshape(lead) if reduction == "none" else np.sum(loss) * share
        dw = h64.T @ dz
        grads = {
            "h": (dz @ wt.T).reshape(h.shape),
            "weight": dw.T if transpose else dw,
            "bias": np.sum(dz, 0),
        }

        # magnitudes: the terms of each result, and how far a logit's rounding moves it
        u = np.abs(z) * float(jnp.finfo(zdtype).eps)
        big = 1 + 2 * zl * np.abs(lse)
        dloss = (big[:, None] * p + (1 - s) * hit + s / v) * np.abs(slope)
        row = np.abs(lse) + np.abs(target) + s * np.mean(np.abs(x), -1) + zl * lse**2 + 1
        row = row + np.sum(dloss * u, -1) / loss_tol
        ap = (np.abs(gl) * big + np.abs(gs))[:, None] * p  # |a| x p, a's own terms apart
        moved = ap * (u + np.sum(p * u, -1, keepdims=True))
        if cap:  # the rounding also moves the softcap's slope, by 2 x slope / cap^2 per unit
            moved = moved + np.abs(dz_capped * 2 * x * slope / cap**2) * u
        # dz's own terms (a x p against the smoothing's share, which cancel where p is
        # near s / V), and the op's dz, from its float32 p, may round to the other
        # neighbour of the reference's: one unit of h's dtype either way
        target_terms = (np.abs(gl) * (1 - s))[:, None] * hit + (np.abs(gl) * s / v)[:, None]
        terms = (ap + target_terms) * np.abs(slope)
        unit = float(jnp.finfo(dtype).eps)
        adz = terms * (1 + unit / TOL[dtype.name]) + moved / TOL[dtype.name]
        adw = np.abs(h64).T @ adz
        mags = {
            "loss": row.reshape(lead)
            if reduction == "none"
            else np.sum(np.where(ignored, 0.0, row)) * share,
            "lse": (np.abs(lse) + 1 + np.sum(p * np.abs(slope) * u, -1) / loss_tol).reshape(lead),
            "h": (adz @ np.abs(wt).T).reshape(h.shape),
            "weight": adw.T if transpose else adw,
            "bias": np.sum(adz, 0),
        }
        mags = {k: np.where(np.isfinite(m), m, 0.0) for k, m in mags.items()}
    out = (value, lse.reshape(lead)) if with_lse else value
    return out, grads, mags


def assert_matches(out, grads, args, opts, logits_dtype=None):
    """out and grads (of loss_and_grads at ``args``) equal the reference's: dtypes,
    shapes, values."""
    h, w, bias = args[:3]
    ref_out, ref_grads, mags = reference(*args, opts, logits_dtype)
    loss_dtype = "float64" if jnp.dtype(logits_dtype or h.dtype) == jnp.float64 else "float32"
    with_lse = opts.get("return_lse", False)
    outs, refs = (out, ref_out) if with_lse else ((out,), (ref_out,))
    for name, o, r in zip(("loss", "lse")[: len(outs)], outs, refs, strict=True):
        assert o.dtype == loss_dtype and o.shape == r.shape, (name, o.dtype, o.shape)
        o, r, m = (jnp.atleast_1d(a) for a in (o, r, mags[name]))
        assert_close(o, r, m, loss_dtype, name)
    for k, grad in grads.items():
        x = dict(h=h, weight=w, bias=bias)[k]
        if x is None:
            assert grad is None, k
            continue
        assert grad.dtype == x.dtype and grad.shape == x.shape, (k, grad.dtype, grad.shape)
        # float64 gradients: the op's GEMMs and sums accumulate in float32
        tol = "float32" if x.dtype == jnp.float64 else x.dtype.name
        assert_close(grad, ref_grads[k], mags[k], tol, f"d{k}")


def compare(backend, opts, *args, wrt=ALL, jit=True, count=None, logits_dtype=None):
    """loss_and_grads against the reference, compiled (launching ``count`` kernels on the
    GPU; by default ``launches``) or eagerly; returns (out, grads)."""
    f = loss_and_grads(wrt, **opts)
    if jit:
        vocab = args[1].shape[0 if opts.get("transpose_weight") else 1]
        count = launches(args[3].size, opts, vocab) if count is None else count
        out, grads = run(backend, f, *args, launches=count)
    else:
        out, grads = f(*args)
    assert_matches(out, grads, args, opts, logits_dtype)
    return out, grads


def losses(out, opts):
    return out[0] if opts.get("return_lse") else out


# -- 1. the grid, every option ---------------------------------------------------------

# (reduction, options, bias, transposed weight), in turn over the grid's cases
MIXES = [
    ("mean", {}, False, False),
    ("none", dict(label_smoothing=0.1, return_lse=True), True, False),
    ("sum", dict(z_loss=1e-3, logit_softcap=20.0), False, True),
    ("none", dict(logit_softcap=30.0, z_loss=1e-4), True, True),
    ("mean", dict(label_smoothing=0.05, z_loss=1e-4), True, False),
]


def with_mixes(params):
    """Each (backend, T, V, dtype) with the next of MIXES on its backend."""
    out = []
    for i, p in enumerate(params):
        k = sum(q.values[0] == p.values[0] for q in params[:i]) % len(MIXES)
        out.append(pytest.param(*p.values, k, marks=p.marks, id=f"{p.id}-{k}"))
    return out


GRID = with_mixes(grid("linear_cross_entropy"))


def grid_case(k):
    """Whether the grid case of mix k has a bias, whether its weight is (V, d), and the
    options."""
    reduction, extra, with_bias, transpose = MIXES[k]
    opts = dict(reduction=reduction, transpose_weight=transpose, chunk_size=CHUNK, **extra)
    return with_bias, transpose, opts


@pytest.mark.parametrize("backend,t,v,dtype,k", GRID)
def test_loss_and_gradients_match_float64(backend, t, v, dtype, k):
    """T = 300 (two whole chunks and a part) by every vocabulary of the grid, with the
    mixes of options in turn."""
    with_bias, transpose, opts = grid_case(k)
    h, w, bias, *rest = draw(t, D, v, dtype, transpose=transpose)
    compare(backend, opts, h, w, bias if with_bias else None, *rest)


OPTIONS = [
    dict(reduction="mean"),
    dict(reduction="sum", bias=True, chunk_size=16),
    dict(reduction="none", bias=True, transpose_weight=True, chunk_size=8),
    dict(reduction="mean", label_smoothing=0.1, chunk_size=5),
    dict(reduction="none", z_loss=0.01, chunk_size=16),
    dict(reduction="sum", logit_softcap=5.0, transpose_weight=True, chunk_size=10),
    dict(reduction="none", return_lse=True, bias=True, chunk_size=8),
    dict(reduction="sum", return_lse=True, z_loss=0.01, transpose_weight=True),
    dict(reduction="sum", ignore_index=0, chunk_size=16),
    dict(reduction="none", ignore_index=0, label_smoothing=0.2, transpose_weight=True),
    dict(
        reduction="mean",
        return_lse=True,
        label_smoothing=0.1,
        z_loss=0.01,
        logit_softcap=4.0,
        bias=True,
        transpose_weight=True,
        ignore_index=0,
        chunk_size=12,
    ),
]


def _id(options):
    return "-".join(f"{k}={v}" for k, v in options.items())


# every case in float32; in bfloat16 those with a bias or the (V, d) layout
CASES = [pytest.param(o, "float32", id=f"float32-{_id(o)}") for o in OPTIONS] + [
    pytest.param(o, "bfloat16", id=f"bfloat16-{_id(o)}")
    for o in OPTIONS
    if o.get("bias") or o.get("transpose_weight")
]


@pytest.mark.parametrize("options,dtype", CASES)
@pytest.mark.parametrize("backend", backends())
def test_every_option_matches_float64(backend, options, dtype):
    opts = dict(options)
    with_bias = opts.pop("bias", False)
    ignore_index = opts.get("ignore_index", IGNORE)
    transpose = opts.get("transpose_weight", False)
    h, w, bias, labels, g, g_lse = draw(dtype=dtype, transpose=transpose, ignore_index=ignore_index)
    args = (h, w, bias if with_bias else None, labels, g, g_lse)
    out, grads = compare(backend, opts, *args)
    ignored = np.asarray(labels == ignore_index)
    assert ignored.any() and not ignored.all()
    if opts["reduction"] == "none":
        assert (np.asarray(losses(out, opts))[ignored] == 0).all()
    if not opts.get("return_lse"):  # ignored rows have no gradient
        assert (np.asarray(grads["h"].astype(jnp.float32))[ignored] == 0).all()


# -- 2. chunks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "t,chunk,reduction",
    [
        (64, 16, "none"),
        (37, 8, "none"),
        (37, 8, "sum"),
        (7, 64, "mean"),
        (7, 1, "none"),
        (7, 1, "sum"),
        (1, None, "mean"),
        (1, 4, "none"),
    ],
)
@pytest.mark.parametrize("backend", backends())
def test_chunk_sizes(backend, t, chunk, reduction):
    h, w, bias, labels, g, g_lse = draw(t, tag=(chunk,))
    labels = labels.at[0].set(5)  # at least one row counted
    compare(backend, dict(reduction=reduction, chunk_size=chunk), h, w, bias, labels, g, g_lse)


# -- 3. ignored rows, labels out of range, NaN and inf -----------------------------------


@pytest.mark.parametrize("backend", backends())
def test_a_chunk_with_every_row_ignored(backend):
    h, w, bias, labels, g, g_lse = draw(ignored=0.0)
    labels = labels.at[8:16].set(IGNORE)  # the second of 5 chunks of 8 rows
    for reduction in ("none", "mean"):
        opts = dict(reduction=reduction, chunk_size=8)
        _, grads = compare(backend, opts, h, w, bias, labels, g, g_lse)
        assert (np.asarray(grads["h"])[8:16] == 0).all()


@pytest.mark.parametrize(
    "reduction,return_lse", [("none", False), ("sum", False), ("mean", False), ("mean", True)]
)
@pytest.mark.parametrize("backend", backends())
def test_every_row_ignored(backend, reduction, return_lse):
    """ "mean" is NaN, "sum" 0, the rows 0; the loss's gradients are 0, as in
    cross_entropy."""
    h, w, bias, labels, g, g_lse = draw()
    labels = jnp.full_like(labels, IGNORE)
    opts = dict(reduction=reduction, return_lse=return_lse, chunk_size=8)
    out, grads = compare(backend, opts, h, w, bias, labels, g, g_lse)
    loss = losses(out, opts)
    if reduction == "mean":
        assert np.isnan(loss)
    else:
        np.testing.assert_array_equal(loss, np.zeros(np.shape(loss)))
    if not return_lse:
        for grad in grads.values():
            np.testing.assert_array_equal(grad, np.zeros(grad.shape))


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("backend", backends())
def test_labels_out_of_range(backend, reduction):
    """NaN losses for those rows, NaN gradient rows of h, an all-NaN weight gradient."""
    h, w, bias, labels, g, g_lse = draw(ignored=0.1)
    bad = np.array([3, 11, 20])
    labels = labels.at[bad].set(jnp.array([V, -1, 10_000]))
    opts = dict(reduction=reduction, chunk_size=8)
    out, grads = compare(backend, opts, h, w, bias, labels, g, g_lse)
    if reduction == "none":
        assert np.isnan(out[bad]).all()
        assert np.isfinite(np.delete(np.asarray(out), bad)).all()
    else:
        assert np.isnan(out)
    dh = np.asarray(grads["h"])
    assert np.isnan(dh[bad]).all() and np.isfinite(np.delete(dh, bad, 0)).all()
    assert np.isnan(grads["weight"]).all() and np.isnan(grads["bias"]).all()


@pytest.mark.parametrize("backend", backends())
def test_label_out_of_range_without_cotangent_has_finite_gradient(backend):
    """A row whose loss has cotangent 0 gives no NaN to the gradients, as in cross_entropy."""
    h, w, bias, labels, _, g_lse = draw(ignored=0.0)
    labels = labels.at[5].set(V + 27)
    g = jnp.where(jnp.arange(T) < 5, 1.0, 0.0)
    _, grads = compare(backend, dict(reduction="none", chunk_size=4), h, w, bias, labels, g, g_lse)
    for grad in grads.values():
        assert np.isfinite(grad).all()


# NaN, +inf and -inf in h, an ignored row of NaN, a row of zeros, labels out of range,
# and a chunk of ignored rows (8-15, the second of 5 chunks of 8); a vocabulary the
# kernels split across a cluster of CTAs
SPECIAL_V = dict(cpu=V, gpu=50257)


def special_inputs(v, dtype):
    h, w, _, labels, g, g_lse = draw(v=v, dtype=dtype)
    h = h.at[1, 3].set(jnp.nan).at[2, 0].set(jnp.inf).at[20, 5].set(-jnp.inf)
    h = h.at[5].set(0.0).at[10, 1].set(jnp.nan)
    labels = labels.at[jnp.array([1, 2, 20])].set(7).at[8:16].set(IGNORE)
    return h, w, None, labels.at[3].set(v).at[4].set(-1), g, g_lse


@pytest.mark.parametrize("reduction,return_lse", [("none", True), ("mean", False), ("sum", True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", backends())
def test_special_values(backend, dtype, reduction, return_lse):
    """NaN and inf where the reference has them, the rest close."""
    args = special_inputs(SPECIAL_V[backend], dtype)
    opts = dict(reduction=reduction, return_lse=return_lse, chunk_size=8)
    out, _ = compare(backend, opts, *args)
    loss = losses(out, opts)
    assert np.isnan(loss).any()
    if reduction == "none":
        assert np.isnan(loss[1]) and loss[10] == 0 and np.isnan(loss[3:5]).all()
    if return_lse:
        lse = np.asarray(out[1])
        assert np.isnan(lse[[1, 10]]).all() and lse[2] == lse[20] == np.inf


# -- 4. memory ---------------------------------------------------------------------------


def fused(chunk, **fixed):
    """linear_cross_entropy in chunks of ``chunk`` rows."""
    return functools.partial(quack_jax.linear_cross_entropy, chunk_size=chunk, **fixed)


def unfused(h, w, labels):
    """quack_jax.cross_entropy of the full logits."""
    return quack_jax.cross_entropy(h @ w, labels)


MEMORY_V = 32000  # a vocabulary of the grid

# vocabularies that are not a multiple of 8: the GEMMs take the weight padded with zeros
ODD_V = dict(cpu=997, gpu=50257)


@pytest.mark.parametrize("chunk", (16, T))
@pytest.mark.parametrize("transpose", (False, True))
@pytest.mark.parametrize("reduction", ("mean", "none"))
@pytest.mark.parametrize("backend", backends())
def test_a_misaligned_vocabulary_pads_only_the_gemms(backend, reduction, transpose, chunk):
    """Values and gradients of the vocabulary alone, as the reference's: the padding's
    zero logits never reach the loss, lse or label smoothing's mean, and dW and the bias
    gradient keep the weight's shape. The GEMMs take the padded weight, or per-row losses
    its vocabulary slices, the last one padded: every vocabulary width a GEMM sees is a
    multiple of 64. In one chunk, the per-row backward takes the forward's logits of the
    vocabulary alone."""
    v = ODD_V[backend]
    h, w, bias, labels, g, g_lse = draw(v=v, transpose=transpose, tag=("odd",))
    opts = dict(reduction=reduction, transpose_weight=transpose, chunk_size=chunk)
    opts |= dict(label_smoothing=0.1, return_lse=reduction == "none")
    _, grads = compare(backend, opts, h, w, bias, labels, g, g_lse)
    assert grads["weight"].shape == w.shape and grads["bias"].shape == bias.shape
    text = jax.jit(loss_and_grads(ALL, **opts)).lower(h, w, bias, labels, g, g_lse).as_text()
    t = h.shape[0]
    rows = {t, -(-t // -(-t // chunk)), HIDDEN}  # the rows, a chunk's rows, d
    gemms = [line for line in text.splitlines() if "dot_general" in line]
    dims = {int(n) for line in gemms for n in re.findall(r"(\d+)x", line)}
    assert gemms and all(n in rows or n % 64 == 0 for n in dims), dims


def compiled_grads(fn, t, d, v):
    """The compiled value_and_grad (of h and W, of the sum of per-row losses) in
    bfloat16."""
    args = (
        jax.ShapeDtypeStruct((t, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
        jax.ShapeDtypeStruct((t,), jnp.int32),
    )

    def total(*args):
        return jnp.sum(fn(*args))

    return jax.jit(jax.value_and_grad(total, argnums=(0, 1))).lower(*args).compile()


def compiled_bytes(fn, t, d, v):
    """temp + output bytes of ``compiled_grads``."""
    memory = compiled_grads(fn, t, d, v).memory_analysis()
    return memory.temp_size_in_bytes + memory.output_size_in_bytes


def compiled_text(fn, t, d, v):
    return compiled_grads(fn, t, d, v).as_text()


@pytest.mark.parametrize("backend", backends())
def test_memory_is_below_the_unfused_loss_by_the_logits(backend):
    """The compiled value_and_grad needs at least the full logits less one chunk's
    logits fewer bytes than the unfused loss."""
    t, d, v, chunk = 4096, 64, MEMORY_V, 512
    ours, theirs = compiled_bytes(fused(chunk), t, d, v), compiled_bytes(unfused, t, d, v)
    assert ours <= theirs - (t * v * 2 - chunk * v * 2), (ours, theirs)


@pytest.mark.parametrize("backend", backends())
def test_a_last_chunk_that_overlaps_costs_no_memory(backend):
    """4001 rows in chunks of at most 512 go as 8 of 501 rows, the last one overlapping
    the one before it; that needs no more memory than 4008 rows in 8 chunks of 501."""
    d, v = 64, MEMORY_V
    overlapping = compiled_bytes(fused(512), 4001, d, v)
    assert overlapping <= compiled_bytes(fused(501), 4008, d, v)


@pytest.mark.parametrize("backend", backends())
def test_kept_logits_cost_no_memory(backend):
    """The logits that one slice (the whole vocabulary) keeps for the per-row backward
    take the place of those it would make again: per-row losses need no more memory
    than a "sum", whose gradients come from the forward pass over the same logits. The
    per-row path may add up to 64 bytes a row (its statistics), nothing the size of the
    logits."""
    t, d, v = 4096, 64, MEMORY_V
    per_row = compiled_bytes(fused(t, reduction="none"), t, d, v)
    assert per_row <= compiled_bytes(fused(t, reduction="sum"), t, d, v) + 64 * t


@pytest.mark.parametrize("backend", backends("gpu"))
def test_kept_slices_cost_their_logits_alone(monkeypatch, backend):
    """Per-row losses over 4 vocabulary slices: keeping none costs no more than a "sum"
    in chunks of rows (114.3 against 120.3 MB on an H100; 203.4 MB where the backward's
    slices were the forward's), and keeping the logits of 2 costs those logits and less
    than half a slice's more (266.9 MB: at d = 64, XLA batches the slices' GEMMs, whose
    outputs and cuBLAS workspaces take the rest). The backward kernel writes dlogits
    over each slice's logits, kept or made again, with no copy of them."""
    t, d, v, chunk = 4096, 64, MEMORY_V, 1024
    slice_bytes = t * 8000 * 2  # 32000 in 4 slices
    kept = compiled_bytes(fused(chunk, reduction="none"), t, d, v)
    text = compiled_text(fused(chunk, reduction="none"), t, d, v)
    kernels = [line for line in text.splitlines() if f'custom_call_target="{_ffi.TARGET}"' in line]
    backward = [line for line in kernels if "output_to_operand_aliasing" in line]
    # the 2 kept slices, and the loop that makes the others again
    assert len(backward) == 3 and all("(0, {})}" in x for x in backward), backward
    assert not re.search(r"bf16\[4096,8000\]\S* copy\(", text), "a copy of a slice"
    monkeypatch.setattr(linear_options, "KEEP_FRACTION", 0.0)
    none_kept = compiled_bytes(fused(chunk, reduction="none"), t, d, v)
    summed = compiled_bytes(fused(chunk, reduction="sum"), t, d, v)
    assert kept <= none_kept + 2.5 * slice_bytes, (kept, none_kept)
    assert none_kept <= summed, (none_kept, summed)


@pytest.mark.parametrize("keep, made", [(0.5, 3), (0.0, 4)])
@pytest.mark.parametrize("backend", backends("gpu"))
def test_a_slice_made_again_is_not_the_forward_pass(monkeypatch, backend, keep, made):
    """Per-row losses over 2 vocabulary slices, one or none kept: the loop over the
    slices not kept runs once in each pass, and XLA, which removes such loops, must not
    take the backward's logits of a slice for the forward's (that would hold them from
    one pass to the other). The compiled program makes a slice's logits (a GEMM, cuBLAS's
    or XLA's own) 2 times in the forward pass and once more for each slice not kept."""
    monkeypatch.setattr(linear_options, "KEEP_FRACTION", keep)
    text = compiled_text(fused(2048, reduction="none"), 4096, 64, MEMORY_V)
    logits = re.compile(r"^\s*%\S+ = \(?bf16\[4096,16000\].*(calls=%gemm_fusion|__cublas)")
    found = [line for line in text.splitlines() if logits.search(line)]
    assert len(found) == made, "\n".join(found)


INPLACE_CASE = (4096, 256, 128256, 1024)  # t, d, v, chunk


def grads_case(dtype, transpose, shape=INPLACE_CASE):
    """The mean loss's value_and_grad (of h and W) in chunks, and its arguments
    (shape-dtype structs), at ``shape`` (t, d, v, chunk): by default the in-place
    test's."""
    t, d, v, chunk = shape
    h = jax.ShapeDtypeStruct((t, d), dtype)
    w = jax.ShapeDtypeStruct((v, d) if transpose else (d, v), dtype)
    labels = jax.ShapeDtypeStruct((t,), jnp.int32)
    loss = fused(chunk, transpose_weight=transpose)
    return jax.value_and_grad(loss, argnums=(0, 1)), (h, w, labels), shape


DW_CASE = dict(cpu=(96, 64, 1000, 32), gpu=(8192, 2048, 128256, 2048))  # t, d, v, chunk


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("backend", backends())
def test_dw_accumulates_in_its_gemm(backend, transpose):
    """A "mean" loss sums dW over its chunks in float32 as each chunk's dW GEMM's output
    added to the sum: the first chunk's GEMM writes it, and in the loop over the others
    the GEMM's float32 result goes into an add with the loop's dW and nothing else. On
    the GPU, XLA folds that add into the GEMM (a cuBLAS call with beta = 1), and no
    fusion of its own writes a float32 dW."""
    f, args, (_, d, v, _) = grads_case("bfloat16", transpose, DW_CASE[backend])
    lowered = jax.jit(f).lower(*args)
    dw = f"{v}x{d}" if transpose else f"{d}x{v}"
    if backend == "cpu":
        text = lowered.as_text()
        lines = [line.strip() for line in text.splitlines()]
        gemm = rf"(%\S+) = stablehlo.dot_general .* -> tensor<{dw}xf32>"
        made = [i for i, line in enumerate(lines) if re.fullmatch(gemm, line)]
        assert len(made) == 2, made  # the first chunk's, the loop's
        name = re.fullmatch(gemm, lines[made[1]])[1]
        carried = r"%(arg|iterArg)\w*"  # the loop's dW: the body's argument
        pair = rf"({carried}, {name}|{name}, {carried})"
        added = rf"(%\S+) = stablehlo.add {pair} : tensor<{dw}xf32>"
        found = re.fullmatch(added, lines[made[1] + 1])
        assert found, lines[made[1] : made[1] + 2]
        rest = lines[made[1] + 2 :]
        end = next(i for i, line in enumerate(rest) if re.match(r"(stablehlo\.)?return ", line))
        uses = [line for line in rest[: end + 1] if re.search(rf"{found[1]}\b", line)]
        assert uses == [rest[end]], uses  # the loop's next dW, as it is
        return
    text = lowered.compile().as_text()
    shape = f"[{v},{d}]" if transpose else f"[{d},{v}]"
    beta_one = [line for line in text.splitlines() if "__cublas" in line and '"beta":1' in line]
    assert beta_one and all(f"f32{shape}" in line for line in beta_one), beta_one
    fusions = re.findall(rf"= f32{re.escape(shape)}\S* fusion\(", text)
    assert not fusions, fusions


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("backend", backends("gpu"))
def test_logits_are_overwritten_in_place(backend, dtype, transpose):
    """The compiled value_and_grad aliases the gradient kernel's output to its logits,
    holds no second (chunk, V) buffer, and makes no transposed copy of the weight."""
    f, args, (t, d, v, chunk) = grads_case(dtype, transpose)
    e = np.dtype(dtype).itemsize
    compiled = jax.jit(f).lower(*args).compile()
    text = compiled.as_text()
    kernels = [line for line in text.splitlines() if f'custom_call_target="{_ffi.TARGET}"' in line]
    assert kernels and all("output_to_operand_aliasing={{3}: (0, {})}" in x for x in kernels)
    chunk_bytes, dw_bytes, dh_bytes = chunk * v * e, d * v * 4, t * d * e
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < dw_bytes + dh_bytes + 1.5 * chunk_bytes, (temp, chunk_bytes, dw_bytes)
    for op in ("transpose", "copy"):
        for shape in (f"[{v},{d}]", f"[{d},{v}]"):
            pattern = rf"{'bf16' if dtype == 'bfloat16' else 'f32'}{re.escape(shape)}\S* {op}\("
            assert not re.search(pattern, text), f"a {op} of the weight: {pattern}"


# -- 5. the gradient of h alone, or of the weight alone ------------------------------------


@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("wrt", ["h", "weight"])
@pytest.mark.parametrize("backend", backends())
def test_gradient_of_one_argument(backend, wrt, reduction):
    args = draw()
    opts = dict(reduction=reduction, chunk_size=8)
    compare(backend, opts, *args, wrt=(wrt,))
    # the op is asked for that gradient only
    jaxpr = str(jax.make_jaxpr(loss_and_grads((wrt,), **opts))(*args))
    made = re.findall(r"needs=Needs\((h=\w+, weight=\w+, bias=\w+), args=\(\)\)", jaxpr)
    want = "h=True, weight=False, bias=False" if wrt == "h" else "h=False, weight=True, bias=False"
    assert want in made and all("True" not in m or m == want for m in made), made


# (options, vocabulary, chunk, free memory) -> GEMMs in the lowering of the gradients and
# of the value alone; a chunked loop has each GEMM twice (its first chunk's body and the
# loop's), a loop over slices once, and each slice after it once
SCHEDULES = {
    # the gradients in the forward pass, in chunks of rows: 3 GEMMs a body
    "mean": (dict(reduction="mean"), V, 8, None, 6, 2),
    "sum": (dict(reduction="sum"), V, 8, None, 6, 2),
    # 8 slices (7 of 128, then 104), the last 4 kept: 1 (the loop) + 4 GEMMs in the
    # forward, then 2 x 4 for the kept and 3 in the loop that makes the others again
    "none, slices": (dict(reduction="none"), V, 8, None, 16, 2),
    "lse, slices": (dict(reduction="mean", return_lse=True), V, 8, None, 16, 2),
    # no memory to keep any: each slice's logits made again, 3 in the loop and 3 after
    "none, slices, none kept": (dict(reduction="none"), V, 8, 0, 8, 2),
    # one slice holds the vocabulary: its logits kept, 1 + 2
    "none, one slice": (dict(reduction="none"), V, T, None, 3, 1),
    # more rows than the vocabulary: chunks of rows, 1 + 3 a body
    "none, chunks of rows": (dict(reduction="none"), 32, 8, None, 8, 2),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_schedule_takes_its_gemms(monkeypatch, name):
    """The GEMMs of each schedule: a "sum" or "mean" loss makes its gradients with the
    logits (three a chunk); per-row losses (or lse) go over vocabulary slices, whose
    backward makes again the logits of those not kept (one GEMM, then two or three), or
    where the rows outnumber the vocabulary over chunks of rows, whose backward makes
    every chunk's again (one, then three)."""
    options, v, chunk, free, grads, value = SCHEDULES[name]
    if free is not None:
        monkeypatch.setattr(linear_options, "KEEP_FRACTION", 0.0)
    h, w, _, labels, _, _ = draw(v=v)

    def loss(h, w):
        out = quack_jax.linear_cross_entropy(h, w, labels, chunk_size=chunk, **options)
        return jnp.sum(out[0] if isinstance(out, tuple) else out)

    assert gemm_count(jax.grad(loss, argnums=(0, 1)), h, w) == grads
    assert gemm_count(loss, h, w) == value  # the value alone: the logits' GEMMs


@pytest.mark.parametrize(
    "rows, vocab, chunk, dtype, free, keep, widths, kept",
    [
        # 5 chunks: 8 slices, and 8 parts of 1000 are not a multiple of 8 wide
        (37, 1000, 8, "float32", None, True, (128,) * 7 + (104,), 4),
        (37, 1000, 8, "float32", None, False, (128,) * 7 + (104,), 0),
        (37, 1000, 10, "float32", None, True, (256,) * 3 + (232,), 2),
        (37, 1000, 200, "float32", None, True, (1000,), 1),
        (37, 1000, 19, "float32", None, True, (512, 488), 1),  # 500 is not 8-wide
        (37, 1000, 37, "float32", None, True, (1000,), 1),  # one slice: kept
        (37, 32, 37, "float32", None, True, (32,), 1),
        (37, 32, 8, "float32", None, True, None, None),  # chunks of rows
        (0, 1000, 1, "float32", None, True, (1000,), 1),
        (8192, 256000, 2048, "bfloat16", None, True, (64000,) * 4, 2),
        (8192, 256000, 2048, "bfloat16", 4 << 30, True, (64000,) * 4, 1),  # 1 GiB of 4
        (8192, 256000, 2048, "bfloat16", 0, True, (64000,) * 4, 0),
        (16384, 128256, 4096, "bfloat16", None, True, (32064,) * 4, 2),
        (12288, 128256, 4096, "bfloat16", None, True, (32064,) * 4, 2),  # 3 chunks: 4
        (16384, 152064, 2048, "bfloat16", None, True, (19008,) * 8, 4),
        # no equal parts: 128-wide slices but the last
        (4096, 50257, 1024, "float32", None, True, (12672,) * 3 + (12241,), 2),
    ],
)
def test_slices(monkeypatch, rows, vocab, chunk, dtype, free, keep, widths, kept):
    """Per-row losses' vocabulary slices: as many as the chunks of rows, rounded up to a
    power of two; equal where that is a multiple of 8 wide, else a multiple of 128 wide
    but the last. With ``keep``, the last half of them (all of one) keep their logits,
    within 1/4 of the free memory; None (chunks of rows) where the rows outnumber the
    vocabulary and one chunk does not hold them
    (docs/decisions/028-per-row-losses-over-vocabulary-slices.md)."""
    monkeypatch.setattr(linear_options, "_free_bytes", lambda: free)
    got = LinearOptions(False, chunk, dtype).slices(rows, vocab, keep)
    assert got == (None if widths is None else Slices(widths, kept))


@pytest.mark.parametrize("vocab", [32000, 50257, 128256, 152064, 256000])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_chunks_give_the_packaged_slice_counts(monkeypatch, vocab, dtype):
    """With the default chunk, per-row losses over any number of rows take one of
    ``default_slice_counts`` (the counts whose slices' kernels the wheel carries), or
    chunks of rows; and each count's slices are as wide as ``slice_widths`` says."""
    monkeypatch.setattr(linear_options, "_free_bytes", lambda: None)
    itemsize = np.dtype(dtype).itemsize
    counts = linear_options.default_slice_counts(vocab, itemsize)
    widths = {linear_options.slice_widths(vocab, count) for count in counts}
    taken = set()
    for rows in (*range(0, 2 * vocab, 997), vocab, 2 * vocab):
        chunk = linear_options.default_chunk(rows, vocab, itemsize)
        slices = LinearOptions(False, chunk, dtype).slices(rows, vocab, keep=False)
        assert (slices is None) == (rows > max(chunk, vocab)), rows
        if slices is not None:
            assert slices.widths in widths, (rows, slices.widths)
            taken.add(slices.widths)
    assert taken == widths


@pytest.mark.parametrize("options", [dict(reduction="none"), dict(reduction="sum")])
@pytest.mark.parametrize("chunk", [T, 8])
def test_per_row_dw_in_weight_dtype(options, chunk):
    """Over vocabulary slices, the per-row backward's dW GEMMs write the weight's dtype:
    each slice's dW is whole when its GEMM ends, and nothing scales it after. A "sum"
    (scaled by its cotangent after) and chunks of rows (summed over them) make dW in
    float32."""
    h, w, _, labels, _, _ = draw()
    h, w = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)

    def loss(h, w):
        out = quack_jax.linear_cross_entropy(h, w, labels, chunk_size=chunk, **options)
        return jnp.sum(out.astype(jnp.float32))

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w).as_text()
    dtypes = set(re.findall(rf"dot_general.*-> tensor<{HIDDEN}x\d+x(\w+)>", text))
    assert dtypes == ({"bf16"} if options["reduction"] == "none" else {"f32"})


@pytest.mark.parametrize(
    "t, v, chunk, free, transpose",
    [
        (37, 1000, 37, None, False),  # one slice, kept
        (37, 16000, 8, None, True),  # 8 slices of 2000, 4 kept, 4 in the loop
        (37, 16000, 8, 0, False),  # 8 slices, none kept: 7 in the loop, the last after it
        (37, 9973, 3, None, True),  # 16 slices of 640 but the last (373, padded), 8 kept
        (37, 32, 8, None, False),  # chunks of rows
    ],
)
@pytest.mark.parametrize("backend", backends())
def test_every_per_row_schedule_matches_float64(monkeypatch, backend, t, v, chunk, free, transpose):
    """Per-row losses and lse, with a bias, label smoothing and the z-loss, match float64
    on every schedule they can take (``spec.SCHEDULES``, which the GPU's kernels are
    built for): slices kept or made again, in the loop or after it, the last one
    padded, and chunks of rows."""
    assert (t, v, chunk) in lce_spec.SCHEDULES
    if free is not None:
        monkeypatch.setattr(linear_options, "KEEP_FRACTION", 0.0)
    opts = dict(lce_spec.SCHEDULE_OPTIONS, chunk_size=chunk, transpose_weight=transpose)
    compare(backend, opts, *draw(t, v=v, transpose=transpose, tag=("schedule",)))


class _Device:
    """A device that reports ``free`` bytes of memory (None: no ``memory_stats``)."""

    def __init__(self, free):
        self.free = free

    def memory_stats(self):
        return None if self.free is None else {"bytes_limit": self.free + 7, "bytes_in_use": 7}


@pytest.mark.parametrize(
    "tokens, vocab, itemsize, free, rows",
    [
        (16384, 128256, 2, None, 4096),  # 1 GiB of logits: 4186 rows, in 128s
        (16384, 32000, 4, None, 8320),  # 8388 rows, in 128s
        (8192, 256000, 4, None, 2048),  # 1 GiB holds 1048 rows; at least 2048
        (16384, 524288, 2, None, 2048),
        (8192, 256000, 4, 4 << 30, 512),  # 1/8 of the free memory: 524 rows
        (8192, 256000, 4, 1 << 20, 128),  # at least 128 rows
        (1000, 256000, 4, None, 1000),  # at most every row
        (100, 256000, 4, 1 << 20, 100),
        (0, 256000, 4, None, 1),
    ],
)
def test_default_chunk(monkeypatch, tokens, vocab, itemsize, free, rows):
    """The default chunk: 1 GiB of logits, or 2048 rows where that is more, within 1/8 of
    the free memory, in multiples of 128 rows, at least 128 (or every row), at most every
    row (docs/decisions/027-chunks-of-at-least-2048-rows.md)."""
    from quack_jax.linear_cross_entropy import options

    monkeypatch.setattr(options.jax, "local_devices", lambda: [_Device(free)])
    assert options.default_chunk(tokens, vocab, itemsize) == rows


@pytest.mark.parametrize("backend", backends())
def test_one_chunk_per_example_under_vmap(backend):
    """vmap of per-row losses whose examples each fit one chunk: the forward takes the
    examples' rows together (one chunk each, every chunk's logits kept), the backward
    each example's own; values and gradients are each example's alone."""
    examples = [draw(tag=("vmap", i)) for i in range(3)]
    h, labels, g = (jnp.stack([e[k] for e in examples]) for k in (0, 3, 4))
    w = examples[0][1]

    def vjp(h, w, labels, g):
        def loss(h, w):
            opts = dict(reduction="none", chunk_size=T, precision="highest")  # not TF32
            return quack_jax.linear_cross_entropy(h, w, labels, **opts)

        out, pullback = jax.vjp(loss, h, w)
        return out, pullback(g)

    batched = functools.partial(run_launching, backend, jax.vmap(vjp, in_axes=(0, None, 0, 0)))
    out, (dh, dw) = batched(h, w, labels, g)
    for i in range(len(examples)):
        want, (want_dh, want_dw) = jax.jit(vjp)(h[i], w, labels[i], g[i])
        for got, ref in ((out[i], want), (dh[i], want_dh), (dw[i], want_dw)):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


# -- 6. preferred_element_type and precision -------------------------------------------------


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("backend", backends())
def test_float32_logits_from_bfloat16(backend, reduction):
    """float32 logits of bfloat16 inputs: the values to float32 rounding (bfloat16 logits
    would be off by ~1e-2), the gradients to bfloat16 rounding (dlogits go to the
    backward GEMMs in h's dtype)."""
    args = draw(dtype="bfloat16")
    opts = dict(reduction=reduction, chunk_size=8, preferred_element_type=jnp.float32)
    compare(backend, opts, *args, logits_dtype="float32")


@pytest.mark.parametrize("backend", backends())
def test_float64_logits_without_x64(backend):
    """preferred_element_type=float64 with x64 off: refused naming the argument, or the
    loss of float32 logits (what jnp.dot makes with it)."""
    args = draw()
    opts = dict(reduction="none", chunk_size=8, preferred_element_type=jnp.float64)
    try:
        compare(backend, opts, *args, logits_dtype="float32")
    except (TypeError, ValueError) as error:
        assert "preferred_element_type" in str(error), str(error)[:500]


@pytest.mark.parametrize("precision", ["highest", (jax.lax.Precision.HIGH, "highest")], ids=str)
@pytest.mark.parametrize("backend", backends())
def test_precision_accepted(backend, precision):
    args = draw()
    compare(backend, dict(reduction="sum", precision=precision, chunk_size=8), *args)


@pytest.mark.parametrize("options", [OPTIONS[1], OPTIONS[-1]], ids=_id)
@pytest.mark.parametrize("backend", backends())
def test_implementation_xla(backend, options):
    """implementation="xla": the whole logits and the XLA formulation, differentiated by
    JAX, with no quack_jax primitive in the program; the float64 reference's values."""
    opts = dict(options, implementation="xla")
    with_bias = opts.pop("bias", False)
    transpose, ignore_index = opts.get("transpose_weight", False), opts.get("ignore_index", IGNORE)
    h, w, bias, *rest = draw(transpose=transpose, ignore_index=ignore_index)
    args = (h, w, bias if with_bias else None, *rest)
    jaxpr = str(jax.make_jaxpr(loss_and_grads(ALL, **opts))(*args))
    assert "quack_jax" not in jaxpr
    compare(backend, opts, *args, count=0)


# -- the kernels the gpu tests launch ---------------------------------------------------------


def test_gpu_vocabularies_are_built():
    """The gpu tests' vocabularies beyond the grid (the smaller cases', the special
    values', the memory tests', the misaligned one's, the in-place test's) are among
    those the SPEC's lowerings build, with every kernel variant: prebuild builds no
    others."""
    lengths = gpu_lengths("linear_cross_entropy")
    odd, inplace = ODD_V["gpu"], INPLACE_CASE[2]
    assert {V, SPECIAL_V["gpu"], MEMORY_V, odd, inplace} <= lengths
