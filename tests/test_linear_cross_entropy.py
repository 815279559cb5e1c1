"""quack_jax.linear_cross_entropy through the XLA fallback (CPU): it must equal
``cross_entropy(h @ weight + bias, labels, ...)`` in its values and in the gradients of
h, the weight and the bias.

1. every option (reductions, label smoothing, z-loss, softcap, lse with a cotangent of
   its own, ignore_index, bias, both weight layouts) against a float64 reference written
   here, in float32 and bfloat16; also with jax_enable_x64 on;
2. chunk sizes that divide T or not, larger than T, 1; empty and single-row inputs; two
   leading dims;
3. an ignored chunk and an ignored batch, labels out of range, NaN and inf in h (against
   quack_jax.cross_entropy of the full logits);
4. the memory saved over the unfused loss;
5. sharded jit on 8 host devices (rows split, vocabulary split, both; either weight
   layout) and the collectives it uses; inside shard_map;
6. jax.checkpoint, lax.scan over microbatches, jax.vmap (per-example weight gradients);
7. the gradient of h alone or of the weight alone, and that only it is made;
8. preferred_element_type and precision;
9. argument errors, raised at trace time and naming the argument.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import quack_jax

IGNORE = -100
# error allowed relative to the largest finite magnitude of the reference
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def make_inputs(t, d, v, dtype="float32", seed=0, ignored=0.25, ignore_index=IGNORE, lead=None):
    """h (t, d), or (*lead, d); a (d, v) weight that gives logits of size ~3; a (v,) bias;
    labels in [0, v) with about a fraction ``ignored`` of them ``ignore_index``."""
    k = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(k[0], (t, d), jnp.float32)
    w = 3.0 / np.sqrt(d) * jax.random.normal(k[1], (d, v), jnp.float32)
    b = jax.random.normal(k[2], (v,), jnp.float32)
    labels = jax.random.randint(k[3], (t,), 0, v)
    labels = jnp.where(jax.random.uniform(k[4], (t,)) < ignored, ignore_index, labels)
    if lead is not None:
        h, labels = h.reshape(*lead, d), labels.reshape(lead)
    return h.astype(dtype), w.astype(dtype), b.astype(dtype), labels


def reference(
    h,
    w,
    labels,
    *,
    bias=None,
    transpose_weight=False,
    ignore_index=IGNORE,
    reduction="mean",
    label_smoothing=0.0,
    z_loss=0.0,
    logit_softcap=None,
    return_lse=False,
):
    """cross_entropy(h @ W + bias) in float64 (call it under jax.enable_x64)."""
    h, w = jnp.asarray(h, jnp.float64), jnp.asarray(w, jnp.float64)
    x = h @ (w.T if transpose_weight else w)
    if bias is not None:
        x = x + jnp.asarray(bias, jnp.float64)
    if logit_softcap is not None:
        x = logit_softcap * jnp.tanh(x / logit_softcap)
    v = x.shape[-1]
    lse = jax.nn.logsumexp(x, axis=-1)
    target = jnp.take_along_axis(x, jnp.clip(labels, 0, v - 1)[..., None], -1)[..., 0]
    loss = lse - (1 - label_smoothing) * target - label_smoothing * jnp.mean(x, -1)
    loss = loss + z_loss * lse**2
    inside = (labels >= 0) & (labels < v)
    loss = jnp.where(labels == ignore_index, 0.0, jnp.where(inside, loss, jnp.nan))
    if reduction != "none":
        loss = jnp.sum(loss)
        if reduction == "mean":
            loss = loss / jnp.sum(labels != ignore_index)
    return (loss, lse) if return_lse else loss


def fused(chunk, **fixed):
    """linear_cross_entropy in chunks of ``chunk`` rows."""
    return functools.partial(quack_jax.linear_cross_entropy, chunk_size=chunk, **fixed)


def unfused(h, w, labels, bias=None, **options):
    """quack_jax.cross_entropy of the full logits."""
    logits = h @ w if bias is None else h @ w + bias
    return quack_jax.cross_entropy(logits, labels, **options)


def objective(fn, labels, seed=9, **options):
    """f(h, w, b=None) -> a scalar of ``fn(h, w, labels, bias=b, **options)`` (the op or a
    reference): for "none" a weighted sum of the rows, else 1.5 times the loss (so no
    cotangent is 1); plus a weighted sum of lse with ``return_lse``."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    row_w = jax.random.uniform(k1, labels.shape, jnp.float32, 0.2, 2.0)
    lse_w = jax.random.normal(k2, labels.shape, jnp.float32)

    def f(h, w, b=None):
        out = fn(h, w, labels, bias=b, **options)
        loss, lse = out if options.get("return_lse") else (out, None)
        if options.get("reduction", "mean") == "none":
            loss = jnp.sum(loss * row_w.astype(loss.dtype))
        else:
            loss = 1.5 * loss
        return loss if lse is None else loss + jnp.sum(lse * lse_w.astype(lse.dtype))

    return f


def values_and_grads(fn, h, w, b, labels, jit=True, **options):
    """fn's output, the objective and its gradients of (h, w), and b unless it is None;
    under jit unless ``jit`` is False."""
    args = (h, w) if b is None else (h, w, b)

    def run(*args):
        f = jax.value_and_grad(objective(fn, labels, **options), tuple(range(len(args))))
        bias = args[2] if len(args) == 3 else None
        return fn(*args[:2], labels, bias=bias, **options), *f(*args)

    return (jax.jit(run) if jit else run)(*args)


def assert_close(out, ref, dtype, what=""):
    """Within TOL of the reference's largest finite magnitude; NaN and inf where the
    reference has them."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, what
    finite = ref[np.isfinite(ref)]
    mag = float(np.max(np.abs(finite))) if finite.size else 1.0
    np.testing.assert_allclose(out, ref, rtol=TOL[dtype], atol=TOL[dtype] * mag, err_msg=what)


def check_against_reference(
    h, w, b, labels, dtype, chunk_size=None, precision=None, jit=True, **options
):
    """Values and gradients of linear_cross_entropy (under jit unless ``jit`` is False)
    against the float64 reference, with the cross-entropy ``options``; returns the op's
    output and gradients."""
    ours = fused(chunk_size, precision=precision)
    out, value, grads = values_and_grads(ours, h, w, b, labels, jit=jit, **options)
    with jax.enable_x64(True):
        args = [None if a is None else jnp.asarray(a, jnp.float64) for a in (h, w, b)]
        ref_out, ref_value, ref_grads = values_and_grads(reference, *args, labels, **options)
    loss_dtype = jnp.promote_types(h.dtype, jnp.float32)
    for o, r, name in zip(
        jax.tree.leaves(out), jax.tree.leaves(ref_out), ("loss", "lse"), strict=False
    ):
        assert o.dtype == loss_dtype, name
        assert_close(o, r, dtype, name)
    assert_close(value, ref_value, dtype, "objective")
    for g, r, a, name in zip(grads, ref_grads, (h, w, b), ("dh", "dweight", "dbias"), strict=False):
        assert g.dtype == a.dtype and g.shape == a.shape, name
        assert_close(g.astype(jnp.float32), r, dtype, name)
    return out, grads


def assert_same_as_unfused(h, w, b, labels, chunk, **options):
    """Values and gradients (h, weight, bias) equal those of cross_entropy(h @ w + b),
    NaN and inf included; returns the op's (out, value, grads)."""
    ours = values_and_grads(fused(chunk), h, w, b, labels, **options)
    theirs = values_and_grads(unfused, h, w, b, labels, **options)
    for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.isnan(o), np.isnan(r))
        assert_close(o, r, "float32")
    return ours


# -- 1. every option against the float64 reference ---------------------------------------

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
def test_values_and_gradients_match_float64(options, dtype):
    options = dict(options)
    with_bias = options.pop("bias", False)
    ignore_index = options.get("ignore_index", IGNORE)
    h, w, b, labels = make_inputs(
        37, 16, 100, dtype, seed=len(_id(options)), ignore_index=ignore_index
    )
    if options.get("transpose_weight"):
        w = w.T
    out, grads = check_against_reference(h, w, b if with_bias else None, labels, dtype, **options)
    ignored = np.asarray(labels == ignore_index)
    assert ignored.any() and not ignored.all()
    if options["reduction"] == "none":
        loss = out[0] if options.get("return_lse") else out
        assert (np.asarray(loss)[ignored] == 0).all()
    if not options.get("return_lse"):  # ignored rows have no gradient
        assert (np.asarray(grads[0].astype(jnp.float32))[ignored] == 0).all()


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_with_x64_enabled(dtype, jit):
    """With jax_enable_x64 on, float32 inputs and float64 ones (the XLA reference) give
    the values and gradients of h, the weight and the bias."""
    with jax.enable_x64(True):
        h, w, b, labels = make_inputs(20, 8, 30, dtype, seed=21)
        for reduction in ("mean", "none"):
            check_against_reference(
                h, w, b, labels, "float32", reduction=reduction, chunk_size=8, jit=jit
            )


# -- 2. chunks, empty and single rows, leading dims ---------------------------------------


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
def test_chunk_sizes(t, chunk, reduction):
    h, w, b, labels = make_inputs(t, 8, 30, seed=t + (chunk or 0), ignored=0.2)
    labels = labels.at[0].set(5)  # at least one row counted
    check_against_reference(h, w, b, labels, "float32", reduction=reduction, chunk_size=chunk)


def test_empty_input():
    """No rows: "none" is empty, "sum" 0, "mean" NaN; the gradients are 0."""
    h, w, b, labels = make_inputs(0, 8, 30)
    assert h.shape == (0, 8)
    rows = fused(4)(h, w, labels, reduction="none")
    assert rows.shape == (0,) and rows.dtype == jnp.float32
    assert fused(4)(h, w, labels, reduction="sum") == 0
    assert np.isnan(fused(4)(h, w, labels, reduction="mean"))
    for reduction in ("none", "sum", "mean"):
        _, _, (dh, dw, db) = values_and_grads(fused(4), h, w, b, labels, reduction=reduction)
        assert dh.shape == (0, 8)
        np.testing.assert_array_equal(dw, np.zeros((8, 30)))
        np.testing.assert_array_equal(db, np.zeros(30))


def test_two_leading_dims():
    h, w, b, labels = make_inputs(24, 16, 50, seed=4, lead=(4, 6))
    assert h.shape == (4, 6, 16)
    for reduction in ("none", "mean"):
        out, _ = check_against_reference(
            h, w, b, labels, "float32", reduction=reduction, chunk_size=5
        )
        assert out.shape == ((4, 6) if reduction == "none" else ())


def test_single_row_without_leading_dim():
    """h of shape (d,) and a scalar label."""
    h, w, b, labels = make_inputs(1, 16, 50, seed=6, ignored=0.0)
    out, _ = check_against_reference(h[0], w, b, labels[0], "float32", reduction="none")
    assert out.shape == ()


# -- 3. ignored rows, labels out of range, NaN and inf ------------------------------------


def test_a_chunk_with_every_row_ignored():
    h, w, b, labels = make_inputs(24, 16, 50, seed=7, ignored=0.0)
    labels = labels.at[8:16].set(IGNORE)
    for reduction in ("none", "mean"):
        _, grads = check_against_reference(
            h, w, b, labels, "float32", reduction=reduction, chunk_size=8
        )
        assert (np.asarray(grads[0])[8:16] == 0).all()


@pytest.mark.parametrize(
    "reduction,return_lse", [("none", False), ("sum", False), ("mean", False), ("mean", True)]
)
def test_every_row_ignored(reduction, return_lse):
    """ "mean" is NaN, "sum" 0, the rows 0; the loss's gradients are 0, as in
    cross_entropy."""
    h, w, b, labels = make_inputs(20, 16, 50, seed=8)
    labels = jnp.full_like(labels, IGNORE)
    out, _, grads = assert_same_as_unfused(
        h, w, b, labels, 8, reduction=reduction, return_lse=return_lse
    )
    loss = out[0] if return_lse else out
    if reduction == "mean":
        assert np.isnan(loss)
    else:
        np.testing.assert_array_equal(loss, np.zeros(np.shape(loss)))
    if not return_lse:
        for g in grads:
            np.testing.assert_array_equal(g, np.zeros(g.shape))


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_labels_out_of_range(reduction):
    """NaN losses for those rows, NaN gradient rows of h, an all-NaN weight gradient."""
    h, w, b, labels = make_inputs(24, 16, 50, seed=10, ignored=0.1)
    bad = np.array([3, 11, 20])
    labels = labels.at[bad].set(jnp.array([50, -1, 10_000]))
    out, _, (dh, dw, db) = assert_same_as_unfused(h, w, b, labels, 8, reduction=reduction)
    if reduction == "none":
        assert np.isnan(out[bad]).all()
        assert np.isfinite(np.delete(np.asarray(out), bad)).all()
    else:
        assert np.isnan(out)
    assert np.isnan(dh[bad]).all() and np.isfinite(np.delete(np.asarray(dh), bad, 0)).all()
    assert np.isnan(dw).all() and np.isnan(db).all()


def test_label_out_of_range_without_cotangent_has_finite_gradient():
    """A row whose loss has cotangent 0 gives no NaN to the gradients, as in cross_entropy."""
    h, w, b, labels = make_inputs(16, 16, 50, seed=11, ignored=0.0)
    labels = labels.at[5].set(77)

    def grads(fn):
        def f(h, w, b):
            return jnp.sum(fn(h, w, labels, bias=b, reduction="none")[:5])

        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(h, w, b)

    for g, r in zip(grads(fused(4)), grads(unfused), strict=True):
        assert np.isfinite(g).all()
        assert_close(g, r, "float32")


@pytest.mark.parametrize("reduction,return_lse", [("none", False), ("mean", False), ("sum", True)])
def test_nan_and_inf_in_h(reduction, return_lse):
    h, w, b, labels = make_inputs(24, 16, 50, seed=12, ignored=0.0)
    labels = labels.at[17].set(IGNORE)
    h = h.at[2, 3].set(jnp.nan).at[9, 0].set(jnp.inf).at[14, 5].set(-jnp.inf)
    h = h.at[17, 1].set(jnp.nan)  # an ignored NaN row
    out, *_ = assert_same_as_unfused(h, w, b, labels, 8, reduction=reduction, return_lse=return_lse)
    loss = out[0] if return_lse else out
    assert np.isnan(loss).any()
    if reduction == "none":
        assert np.isnan(loss[2]) and loss[17] == 0
    if return_lse:
        lse = np.asarray(out[1])
        assert np.isnan(lse[[2, 17]]).all() and lse[9] == lse[14] == np.inf


# -- 4. memory ----------------------------------------------------------------------------


def compiled_bytes(fn, t, d, v):
    """temp + output bytes of the compiled value_and_grad (of h and W) in bfloat16."""
    args = (
        jax.ShapeDtypeStruct((t, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
        jax.ShapeDtypeStruct((t,), jnp.int32),
    )
    compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile()
    memory = compiled.memory_analysis()
    return memory.temp_size_in_bytes + memory.output_size_in_bytes


def test_memory_is_below_the_unfused_loss_by_the_logits():
    """The compiled value_and_grad needs at least the full logits less one chunk's
    logits fewer bytes than the unfused loss."""
    t, d, v, chunk = 4096, 64, 8192, 512
    ours, theirs = compiled_bytes(fused(chunk), t, d, v), compiled_bytes(unfused, t, d, v)
    assert ours <= theirs - (t * v * 2 - chunk * v * 2), (ours, theirs)


def test_a_last_chunk_that_overlaps_costs_no_memory():
    """4001 rows in chunks of at most 512 go as 8 of 501 rows, the last one overlapping
    the one before it; that needs no more memory than 4008 rows in 8 chunks of 501."""
    d, v = 64, 8192
    overlapping = compiled_bytes(fused(512), 4001, d, v)
    assert overlapping <= compiled_bytes(fused(501), 4008, d, v)


# -- 5. sharded on 8 host devices ---------------------------------------------------------

GATHERS = ("all-gather", "all-to-all", "reduce-scatter", "collective-permute")
DATA_MODEL = ((2, 4), ("data", "model"))
# mesh shape and axes; the specs of h and the weight; whether the weight is (V, d)
LAYOUTS = {
    "vocab-8": ((8,), ("m",), PartitionSpec(), PartitionSpec(None, "m"), False),
    "rows-8": ((8,), ("d",), PartitionSpec("d"), PartitionSpec(), False),
    "2x4": (*DATA_MODEL, PartitionSpec("data"), PartitionSpec(None, "model"), False),
    "2x4-transposed": (*DATA_MODEL, PartitionSpec("data"), PartitionSpec("model", None), True),
}
SHARDED_OPTIONS = {
    "mean": dict(reduction="mean"),
    "none": dict(reduction="none"),
    "smoothing-zloss-lse": dict(
        reduction="mean", label_smoothing=0.1, z_loss=0.01, return_lse=True
    ),
}


def count_all_reduces_of_no_logits(text, rows, d, v_local, chunk):
    """Assert that every all-reduce in the compiled ``text`` moves scalars, per-row
    vectors (of at most ``rows``, perhaps with a trailing 1), (at most chunk, d) blocks
    of dh, or the weight gradient's local slice (either layout) or the bias gradient's:
    never a (rows, V) block. Returns how many there are."""
    reduces = 0
    for line in text.splitlines():
        found = re.search(r"= (.*?) all-reduce(-start)?\(", line)
        if not found:
            continue
        reduces += 1
        for dims in re.findall(r"\w+\[([\d,]*)\]", found.group(1)):
            shape = tuple(int(n) for n in dims.split(",") if n)
            per_row = [n for n in shape if n != 1]
            assert (
                (len(per_row) <= 1 and sum(per_row) <= rows)
                or (len(shape) == 2 and shape[0] <= chunk and shape[1] == d)
                or shape in ((d, v_local), (v_local, d), (v_local,))
            ), line
    return reduces


# each option on at least three layouts, on meshes of Explicit axes (make_mesh's
# default) but one of Auto axes
SHARDED_CASES = [
    ("vocab-8", "mean", AxisType.Explicit),
    ("vocab-8", "smoothing-zloss-lse", AxisType.Explicit),
    ("rows-8", "none", AxisType.Explicit),
    ("rows-8", "smoothing-zloss-lse", AxisType.Explicit),
    ("2x4", "mean", AxisType.Explicit),
    ("2x4", "none", AxisType.Explicit),
    ("2x4", "smoothing-zloss-lse", AxisType.Explicit),
    ("2x4-transposed", "none", AxisType.Explicit),
    ("2x4-transposed", "mean", AxisType.Auto),
]


@pytest.mark.parametrize("layout,option,axis_type", SHARDED_CASES)
def test_sharded_matches_unsharded_without_gathering(layout, option, axis_type):
    shape, axes, h_spec, w_spec, transpose = LAYOUTS[layout]
    options = SHARDED_OPTIONS[option]
    mesh = jax.make_mesh(
        shape, axes, axis_types=(axis_type,) * len(axes), devices=jax.devices("cpu")[:8]
    )
    t, d, v, chunk = 64, 16, 200, 12
    h, w, b, labels = make_inputs(t, d, v, seed=13, ignored=0.1)
    if transpose:
        w = w.T
    vocab_axis = w_spec[0 if transpose else 1] if len(w_spec) else None
    row_axis = h_spec[0] if len(h_spec) else None
    specs = (h_spec, w_spec, PartitionSpec(vocab_axis), PartitionSpec(row_axis))
    args = (h, w, b, labels)
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs, strict=True)]

    def loss(h, w, b, labels):
        return objective(fused(chunk, transpose_weight=transpose), labels, **options)(h, w, b)

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    text = f.lower(*sharded).compile().as_text()
    assert not [c for c in GATHERS if c in text], layout
    local_rows = t // (mesh.shape[row_axis] if row_axis else 1)
    v_local = v // (mesh.shape[vocab_axis] if vocab_axis else 1)
    assert count_all_reduces_of_no_logits(text, t, d, v_local, min(chunk, local_rows)) > 0
    (value, grads), (ref, ref_grads) = f(*sharded), f(*args)
    assert_close(value, ref, "float32", "value")
    for g, r, x, name in zip(grads, ref_grads, sharded, ("dh", "dweight", "dbias"), strict=False):
        assert_close(g, r, "float32", name)
        assert g.sharding.is_equivalent_to(x.sharding, g.ndim), name


@pytest.mark.parametrize("what", ["per-row-losses", "sum-and-gradients"])
def test_inside_shard_map(what):
    """Rows split over 8 devices inside shard_map, the weight and bias replicated:
    per-row losses, or a summed loss and its gradients (those of the weight and bias
    summed over the devices), as cross_entropy of the full logits gives them."""
    mesh = jax.make_mesh((8,), ("d",), devices=jax.devices("cpu")[:8])
    rows, whole = PartitionSpec("d"), PartitionSpec()
    h, w, b, labels = make_inputs(64, 16, 96, seed=22)
    hs, ls = (jax.device_put(x, NamedSharding(mesh, rows)) for x in (h, labels))

    def per_device(fn, h, w, b, labels):
        if what == "per-row-losses":
            return fn(h, w, labels, bias=b, reduction="none")
        f = objective(fn, labels, reduction="sum")
        value, (dh, dw, db) = jax.value_and_grad(f, argnums=(0, 1, 2))(h, w, b)
        return jax.lax.psum((value, dw, db), "d"), dh

    out_specs = rows if what == "per-row-losses" else ((whole, whole, whole), rows)
    ours, theirs = (
        jax.jit(
            jax.shard_map(
                functools.partial(per_device, fn),
                mesh=mesh,
                in_specs=(rows, whole, whole, rows),
                out_specs=out_specs,
            )
        )(hs, w, b, ls)
        for fn in (fused(3), unfused)
    )
    for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert_close(o, r, "float32")


# -- 6. checkpoint, scan, vmap -------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_under_checkpoint(reduction):
    h, w, b, labels = make_inputs(37, 16, 60, seed=14)
    grads = []
    for fn in (fused(8), unfused):
        f = jax.checkpoint(objective(fn, labels, reduction=reduction))
        grads.append(jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(h, w, b))
    for o, r in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        assert_close(o, r, "float32")


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_inside_scan_over_microbatches(reduction):
    """A scan over 3 microbatches that accumulates the loss and the weight and bias
    gradients, and stacks the gradients of h."""
    h, w, b, labels = make_inputs(3 * 20, 16, 60, seed=15, lead=(3, 20))

    def train(fn):
        def body(carry, batch):
            hb, lb = batch
            f = objective(fn, lb, reduction=reduction)
            value, (dh, dw, db) = jax.value_and_grad(f, argnums=(0, 1, 2))(hb, w, b)
            loss, gw, gb = carry
            return (loss + value, gw + dw, gb + db), dh

        zero = (jnp.zeros(()), jnp.zeros_like(w), jnp.zeros_like(b))
        return jax.jit(lambda h, labels: jax.lax.scan(body, zero, (h, labels)))(h, labels)

    ours, theirs = train(fused(7)), train(unfused)
    for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert_close(o, r, "float32")


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_vmap_over_examples(reduction):
    """A batch of (h, labels) with the weight shared: the losses, the gradients of h,
    per-example gradients of the weight, and both."""
    h, w, _, labels = make_inputs(4 * 13, 16, 60, seed=16, lead=(4, 13))

    def results(fn):
        def loss(h, w, labels):
            return objective(fn, labels, reduction=reduction)(h, w)

        def batched(h, w, labels):
            values = jax.vmap(lambda h, y: fn(h, w, y, reduction=reduction))(h, labels)
            shared = dict(in_axes=(0, None, 0))
            dh = jax.vmap(jax.grad(loss), **shared)(h, w, labels)
            dw = jax.vmap(jax.grad(loss, argnums=1), **shared)(h, w, labels)
            both = jax.vmap(jax.grad(loss, argnums=(0, 1)), **shared)(h, w, labels)
            return values, dh, dw, both

        return jax.jit(batched)(h, w, labels)

    ours, theirs = results(fused(5)), results(unfused)
    assert ours[2].shape == (4, 16, 60)
    for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert_close(o, r, "float32")


# -- 7. the gradient of h alone, or of the weight alone -------------------------------------


@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("wrt", ["h", "weight"])
def test_gradient_of_one_argument(wrt, reduction):
    h, w, b, labels = make_inputs(37, 16, 60, seed=17)
    argnum = {"h": 0, "weight": 1}[wrt]

    def grad(fn):
        f = objective(fn, labels, reduction=reduction)
        return jax.grad(lambda h, w: f(h, w, b), argnums=argnum)

    assert_close(jax.jit(grad(fused(8)))(h, w), grad(unfused)(h, w), "float32")
    # the op is asked for that gradient only
    made = re.findall(r"needs=Needs\((.*?)\)", str(jax.make_jaxpr(grad(fused(8)))(h, w)))
    want = "h=True, weight=False, bias=False" if wrt == "h" else "h=False, weight=True, bias=False"
    assert want in made and all("True" not in m or m == want for m in made), made


# -- 8. preferred_element_type and precision -------------------------------------------------


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_float32_logits_from_bfloat16(reduction):
    """Equal to cross_entropy(jnp.dot(h, W, preferred_element_type=float32)): the values
    to float32 rounding (bfloat16 logits would be off by ~1e-2), the gradients to
    bfloat16 rounding (dlogits go to the backward GEMMs in h's dtype)."""
    h, w, _, labels = make_inputs(37, 32, 90, "bfloat16", seed=18)

    def logits_f32(h, w, labels, bias=None, **options):
        logits = jnp.dot(h, w, preferred_element_type=jnp.float32)
        return quack_jax.cross_entropy(logits, labels, **options)

    ours = fused(8, preferred_element_type=jnp.float32)
    out, value, (dh, dw) = values_and_grads(ours, h, w, None, labels, reduction=reduction)
    ref, ref_value, (rdh, rdw) = values_and_grads(
        logits_f32, h, w, None, labels, reduction=reduction
    )
    assert_close(out, ref, "float32", "loss")
    assert_close(value, ref_value, "float32", "objective")
    assert dh.dtype == dw.dtype == jnp.bfloat16
    assert_close(dh.astype(jnp.float32), rdh.astype(jnp.float32), "bfloat16", "dh")
    assert_close(dw.astype(jnp.float32), rdw.astype(jnp.float32), "bfloat16", "dweight")


def test_float64_logits_without_x64():
    """preferred_element_type=float64 with x64 off: refused naming the argument, or the
    loss of the logits jnp.dot makes with it (float32)."""
    h, w, _, labels = make_inputs(20, 8, 30, seed=20)
    try:
        out = fused(8, preferred_element_type=jnp.float64)(h, w, labels, reduction="none")
    except (TypeError, ValueError) as error:
        assert "preferred_element_type" in str(error), str(error)[:500]
    else:
        ref = quack_jax.cross_entropy(
            jnp.dot(h, w, preferred_element_type=jnp.float64), labels, reduction="none"
        )
        assert_close(out, ref, "float32")


@pytest.mark.parametrize("precision", ["highest", (jax.lax.Precision.HIGH, "highest")], ids=str)
def test_precision_accepted(precision):
    h, w, b, labels = make_inputs(20, 16, 60, seed=19)
    check_against_reference(
        h, w, b, labels, "float32", reduction="sum", precision=precision, chunk_size=8
    )


# -- 9. argument errors ---------------------------------------------------------------------

H, W, B = np.ones((4, 8), np.float32), np.ones((8, 30), np.float32), np.ones(30, np.float32)
LABELS = np.zeros(4, np.int32)
BAD = [
    (dict(h=[[0.0] * 8] * 4), TypeError, "h must be an array"),
    (dict(h=H.astype(np.int32)), TypeError, "h must have a floating dtype"),
    (dict(weight=3.0), TypeError, "weight must be an array"),
    (dict(weight=W.astype(jnp.bfloat16)), TypeError, "weight must have h's dtype"),
    (dict(bias=B.astype(jnp.bfloat16)), TypeError, "bias must have the weight's dtype"),
    (dict(labels=LABELS.astype(np.float32)), TypeError, "labels must have an integer dtype"),
    (dict(chunk_size=2.5), TypeError, "chunk_size"),
    (dict(chunk_size=True), TypeError, "chunk_size"),
    (dict(weight=np.ones((9, 30), np.float32)), ValueError, "weight must have shape"),
    (dict(weight=np.ones(8, np.float32)), ValueError, "weight must have shape"),
    (dict(weight=W.T), ValueError, "transpose_weight"),
    (dict(transpose_weight=True), ValueError, "weight must have shape"),
    (dict(bias=np.ones(31, np.float32)), ValueError, "bias must have shape"),
    (dict(bias=np.ones((1, 30), np.float32)), ValueError, "bias must have shape"),
    (dict(labels=np.zeros(5, np.int32)), ValueError, "labels must have"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(chunk_size=-1), ValueError, "chunk_size"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(label_smoothing=1.0), ValueError, "label_smoothing"),
    (dict(z_loss=-0.1), ValueError, "z_loss"),
    (dict(logit_softcap=0.0), ValueError, "logit_softcap"),
    (dict(precision="fastest"), ValueError, "precision"),
    (dict(preferred_element_type=jnp.int32), TypeError, "preferred_element_type"),
]


def _bad_id(change):
    (name, value), *_ = change.items()
    if isinstance(value, np.ndarray):
        return f"{name}={value.dtype}{list(value.shape)}"
    return f"{name}={value!r}"[:30]


@pytest.mark.parametrize("change,error,message", BAD, ids=[_bad_id(c) for c, *_ in BAD])
def test_bad_arguments_name_the_argument(change, error, message):
    args = {**dict(h=H, weight=W, labels=LABELS, bias=B), **change}
    traced = {k: v for k, v in args.items() if isinstance(v, np.ndarray)}
    static = {k: v for k, v in args.items() if k not in traced}
    with pytest.raises(error, match=message):
        jax.jit(lambda a: quack_jax.linear_cross_entropy(**a, **static)).trace(traced)
