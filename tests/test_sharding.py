"""Sharded use of every op and its gradient (``checks.sharding_losses``) on both backends:
"cpu" on the 8 host devices (the XLA fallback goes through the same partitioning rules
as the kernels), "gpu" on two sm_90 GPUs (the kernels). Rows split across devices, the
reduced axis split (softmax and the norms combine per-row statistics; cross-entropy runs
its kernels on each device's slice of the vocabulary, with all its options), shard_map,
an uneven split, explicit sharding and the sharding guide's train step: each against the
same function on one device, and no rows moved between the devices. Every op (the
adapters of ``ops.py``), without its options and with them, with its rows split under
jit and inside shard_map, against its float64 reference. linear_cross_entropy with the
rows, the vocabulary or both split (on the host devices), against its float64 reference.

With the rows split, each GPU runs the kernels on its rows: the same bits as on one GPU
(the weight gradient is summed in another order). With the reduced axis split, XLA on
the GPU keeps excess precision inside its fusions (it drops the rounding of the bfloat16
cotangent that the kernels read from memory), so bfloat16 results agree to bfloat16's
tolerance.
"""

import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import ops
import pytest
import test_linear_cross_entropy as lce
from checks import (
    assert_close,
    backend_param,
    backends,
    gpu_lengths,
    key_for,
    run_launching,
    sharding_losses,
)
from conftest import kernel_devices
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import quack_jax
from quack_jax import _ffi
from quack_jax._registry import specs

P = PartitionSpec
OPS = list(sharding_losses(1))
GATHERS = ("all-gather", "all-to-all", "reduce-scatter", "collective-permute")
MESHES = {"8": (8,), "2x4": (2, 4), "4x2": (4, 2), "2": (2,)}
# the rows of each backend's inputs and their length: small on the CPU; on the GPU
# lengths that each family's SPEC builds (``test_gpu_lengths_are_built``), by op name
# prefix
LEAD = {"cpu": (8, 4), "gpu": (2000,)}
SIZES = {"cpu": {"": 96}, "gpu": {"softmax": 5000, "norm": 4096, "cross_entropy": 32000}}
# (backend, mesh, dtype) of the split tests: three meshes of the host devices, two GPUs
DTYPES = ("float32", "bfloat16")  # the GPU's
LAYOUTS = [backend_param("cpu", m, "float32") for m in ("8", "2x4", "4x2")] + [
    backend_param("gpu", "2", d) for d in DTYPES
]
# x's PartitionSpec: the rows over every mesh axis; or the reduced axis over the mesh's
# last axis and the rows over the others
SPECS = {
    "rows": {"8": P("a", None, None), "2x4": P("a", "b", None), "4x2": P("a", "b", None)},
    "reduced": {"8": P(None, None, "a"), "2x4": P("a", None, "b"), "4x2": P(None, "a", "b")},
}
SPECS["rows"]["2"], SPECS["reduced"]["2"] = P("a", None), P(None, "a")


def devices(backend):
    return jax.devices("cpu")[:8] if backend == "cpu" else kernel_devices()


def make_mesh(backend, name, axis_types=None):
    """Mesh ``name`` (axes "a", "b") of the backend's devices; skips where too few."""
    shape, found = MESHES[name], devices(backend)
    if len(found) < math.prod(shape):
        pytest.skip(f"needs {math.prod(shape)} {backend} devices with kernels, found {len(found)}")
    axes = ("a", "b")[: len(shape)]
    return jax.make_mesh(shape, axes, axis_types, devices=found[: math.prod(shape)])


def size(backend, op):
    return next(n for prefix, n in SIZES[backend].items() if prefix in op)


def inputs(backend, op, dtype, lead=None, n=None):
    """x (3 * normal, of ``dtype``), the weight and labels (every 7th row ignored)."""
    lead, n = lead or LEAD[backend], n or size(backend, op)
    kx, kl = jax.random.split(key_for(backend, op, dtype, lead, n))
    x = (3.0 * jax.random.normal(kx, (*lead, n), jnp.float32)).astype(dtype)
    labels = jax.random.randint(kl, (math.prod(lead),), 0, n).at[::7].set(-100)
    return x, jnp.linspace(0.5, 1.5, n), labels.reshape(lead)


def placed(mesh, spec, x, w, labels):
    """x split as ``spec``, the weight as its last axis, the labels as its rows."""
    specs = (spec, P(spec[-1]), P(*spec[:-1]))
    return [
        jax.device_put(a, NamedSharding(mesh, s))
        for a, s in zip((x, w, labels), specs, strict=True)
    ]


def full(spec, rank):
    return tuple(spec) + (None,) * (rank - len(spec))


def magnitude(ref):
    """|ref| plus its largest element: the terms of a row-wise gradient, computed in
    another order or by another implementation, reach that size and can cancel (softmax's
    p * (t - sum(p * t)))."""
    size = np.abs(np.asarray(ref, np.float32))
    return size + np.max(size, initial=0.0)


def assert_matches(got, want, dtype, what, exact=False):
    """value_and_grad results ``got`` against ``want`` (one device): the loss (its terms
    have one sign: |loss| is their size), the gradients of x (the same bits with
    ``exact``) and of the weight."""
    (value, (gx, gw)), (ref, (rgx, rgw)) = jax.device_get((got, want))
    assert_close(value, ref, np.abs(ref), dtype, f"{what}: loss")
    if exact:
        np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(rgx, np.float32))
    else:
        assert_close(gx, rgx, magnitude(rgx), dtype, f"{what}: dx")
    assert_close(gw, rgw, magnitude(rgw), dtype, f"{what}: dweight")


def assert_no_rows_moved(text, share):
    """Nothing gathered, and every all-reduce smaller than ``share``, one device's share
    of the rows: per-row statistics and weight-gradient slices (XLA on the GPU combines
    several into one buffer), never rows."""
    assert not [c for c in GATHERS if c in text], "moves rows between the devices"
    for line in text.splitlines():
        if found := re.search(r"=(.*?)\ball-reduce(-start)?\(", line):
            shape = found.group(1).split("[", 1)[-1].split("]")[0]
            assert math.prod(int(d) for d in re.findall(r"\d+", shape)) < share, line


def check_split(backend, mesh_name, dtype, op, split):
    """The loss and gradients of ``op`` with x split as SPECS[split] equal those on one
    device, and no rows move between the devices; on the GPU, kernels run where they
    apply (not for softmax and the norms with the reduced axis split)."""
    mesh = make_mesh(backend, mesh_name)
    spec = SPECS[split][mesh_name]
    x, w, labels = inputs(backend, op, dtype)
    sharded = placed(mesh, spec, x, w, labels)
    f = jax.jit(jax.value_and_grad(sharding_losses(x.shape[-1])[op], argnums=(0, 1)))
    text = f.lower(*sharded).compile().as_text()
    assert_no_rows_moved(text, x.size // mesh.size)
    if backend == "cpu":
        assert _ffi.TARGET not in text, "the CPU runs the XLA fallback"
    elif split == "rows" or "cross_entropy" in op:
        assert _ffi.TARGET in text, f"{op} runs without kernels"
    got = f(*sharded)
    assert full(got[1][0].sharding.spec, x.ndim) == full(spec, x.ndim)
    want = f(*jax.device_put((x, w, labels), devices(backend)[0]))
    rows = split == "rows"  # then only the weight gradient is summed in another order
    exact = rows and backend == "gpu"  # the XLA fallback may fuse per shape differently
    assert_matches(got, want, "float32" if rows else dtype, f"{op} {split} split", exact)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("backend", "mesh_name", "dtype"), LAYOUTS)
def test_rows_sharded_run_on_their_shard_without_gathering(backend, mesh_name, dtype, op):
    """Forward and gradients (x and weight) on rows sharded over every mesh axis equal the
    unsharded ones, and the compiled program moves no activations between devices."""
    check_split(backend, mesh_name, dtype, op, "rows")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("backend", "mesh_name", "dtype"), LAYOUTS)
def test_reduced_axis_sharded_combines_per_row_statistics(backend, mesh_name, dtype, op):
    """Forward and gradients with the reduced axis split across devices (and the rows
    across the others) equal the unsharded ones; the devices exchange per-row statistics
    (max, sums) and the weight gradient, never rows."""
    check_split(backend, mesh_name, dtype, op, "reduced")


def test_reduced_axis_sharded_in_explicit_mode():
    """With explicit sharding (the mesh axes in the arrays' types) every op takes the
    reduced axis split, and its results keep the split in their types."""
    mesh = make_mesh("cpu", "2x4", (AxisType.Explicit,) * 2)
    spec = SPECS["reduced"]["2x4"]
    for op, loss in sharding_losses(SIZES["cpu"][""]).items():
        x, w, labels = inputs("cpu", op, "float32")
        sharded = placed(mesh, spec, x, w, labels)
        with jax.set_mesh(mesh):
            f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            text = f.lower(*sharded).compile().as_text()
            assert_no_rows_moved(text, x.size // mesh.size)
            got = f(*sharded)
            assert jax.typeof(got[1][0]).sharding.spec == spec, op
            want = jax.value_and_grad(loss, argnums=(0, 1))(x, w, labels)
            assert_matches(got, want, "float32", f"{op} explicit")


@pytest.mark.parametrize("backend", backends())
def test_shard_map_matches_unsharded(backend):
    """softmax of bfloat16 rows in shard_map: each device's rows, the same bits from the
    kernels. XLA's CPU fallback does not promise that: on jax 0.12 it once rounded one
    row's sum differently (1 bfloat16 ulp, 1 CI run in 3), so there it may differ by one
    ulp."""
    mesh = make_mesh(backend, "8" if backend == "cpu" else "2")
    shape = (64, 300) if backend == "cpu" else (LEAD["gpu"][0], SIZES["gpu"]["softmax"])
    x = jax.random.normal(key_for("shard_map", shape), shape, jnp.bfloat16)
    sharded = jax.device_put(x, NamedSharding(mesh, P("a")))
    f = jax.jit(jax.shard_map(quack_jax.softmax, mesh=mesh, in_specs=P("a"), out_specs=P("a")))
    one = jax.jit(quack_jax.softmax)(jax.device_put(x, devices(backend)[0]))
    got, want = np.asarray(f(sharded), np.float32), np.asarray(one, np.float32)
    if backend == "gpu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=0)  # one ulp


@pytest.mark.parametrize(
    ("backend", "mesh_name", "dtype"),
    [backend_param("cpu", "2x4", "float32")] + [backend_param("gpu", "2", d) for d in DTYPES],
)
def test_shard_map_of_every_op_matches_unsharded(backend, mesh_name, dtype):
    """Every op and its gradient on each device's rows inside shard_map (the weight's
    gradient summed across them) equal the unsharded ones."""
    mesh = make_mesh(backend, mesh_name)
    spec = SPECS["rows"][mesh_name]
    rows = P(*spec[:-1])
    for op, loss in sharding_losses(1).items():
        if op == "cross_entropy_mean":
            continue  # a mean over each shard's rows is not the global mean
        x, w, labels = inputs(backend, op, dtype)
        loss = sharding_losses(x.shape[-1])[op]

        def per_shard(x, w, labels, loss=loss):
            value, grads = jax.value_and_grad(loss, argnums=(0, 1))(x, w, labels)
            return jax.lax.psum(value, mesh.axis_names), grads

        f = jax.jit(
            jax.shard_map(
                per_shard,
                mesh=mesh,
                in_specs=(spec, P(), rows),
                out_specs=(P(), (spec, P())),
            )
        )
        got = f(*placed(mesh, spec, x, w, labels))
        one = jax.device_put((x, w, labels), devices(backend)[0])
        want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*one)
        # bfloat16: XLA may round the elementwise parts at other points in shard_map
        assert_matches(got, want, dtype, f"{op} in shard_map")


VOCAB_OPTIONS = {
    "mean": dict(reduction="mean"),
    "rows-lse": dict(reduction="none", return_lse=True),
    "sum-all-options": dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3, logit_softcap=5.0),
    # token_logprobs: the slices' entropies combine too
    "token-logprobs": dict(
        temperature=0.7, return_entropy=True, logit_softcap=5.0, ignore_index=-100
    ),
}
VOCAB_ROWS, VOCAB = 16, 400


def vocab_loss(options):
    def loss(x, labels):
        if options.get("return_entropy"):
            logp, entropy = quack_jax.token_logprobs(x, labels, **options)
            weights = 1.0 + 0.5 * jnp.cos(labels)  # per row, sharded as the rows are
            return jnp.nansum(logp * weights + entropy)
        out = quack_jax.cross_entropy(x, labels, **options)
        return jnp.nansum(out[0] + out[1]) if options.get("return_lse") else jnp.nansum(out)

    return loss


@pytest.mark.parametrize("options", VOCAB_OPTIONS)
@pytest.mark.parametrize(
    ("backend", "mesh_name"),
    [backend_param("cpu", m) for m in ("8", "2x4")] + [backend_param("gpu", "2")],
)
def test_vocab_parallel_cross_entropy_combines_per_row_statistics(backend, mesh_name, options):
    """The vocabulary split across devices (a tensor-parallel LM head), with the rows
    split too on a 2-D mesh: the loss and its gradient equal the unsharded ones, and the
    devices exchange only per-row values (no gather, no all-reduce of a device's share of
    the logits or of a vector of the vocabulary or of its slices)."""
    mesh = make_mesh(backend, mesh_name, (AxisType.Auto,) * len(MESHES[mesh_name]))
    row_spec = "a" if len(mesh.axis_names) == 2 else None
    vocab_axis = mesh.axis_names[-1]
    x = 3.0 * jax.random.normal(key_for("vocab", options), (VOCAB_ROWS, VOCAB), jnp.float32)
    labels = ((jnp.arange(VOCAB_ROWS) * 37) % VOCAB).at[0].set(-100).at[1].set(VOCAB + 3)
    xs = jax.device_put(x, NamedSharding(mesh, P(row_spec, vocab_axis)))
    ls = jax.device_put(labels, NamedSharding(mesh, P(row_spec)))
    f = jax.jit(jax.value_and_grad(vocab_loss(VOCAB_OPTIONS[options])))
    text = f.lower(xs, ls).compile().as_text()
    assert_no_rows_moved(text, x.size // mesh.size)
    vocab_sizes = {str(VOCAB), str(VOCAB // mesh.shape[vocab_axis])}
    for line in text.splitlines():
        if found := re.search(r"=(.*?)\ball-reduce(-start)?\(", line):
            assert not vocab_sizes & set(re.findall(r"\d+", found.group(1))), line
    if backend == "gpu":
        assert _ffi.TARGET in text, "cross-entropy runs without kernels"
    (value, grad), (ref, ref_grad) = f(xs, ls), f(*jax.device_put((x, labels), devices(backend)[0]))
    assert full(grad.sharding.spec, 2) == (row_spec, vocab_axis)
    (value, grad), (ref, ref_grad) = jax.device_get(((value, grad), (ref, ref_grad)))
    assert_close(value, ref, np.abs(ref), "float32", f"{options}: loss")
    assert_close(grad, ref_grad, magnitude(ref_grad), "float32", f"{options}: dlogits")
    if options not in ("rows-lse", "token-logprobs"):  # nansum drops row 1's NaN cotangent
        assert np.isnan(grad[1]).all() and (grad[0] == 0).all()


@pytest.mark.parametrize(
    ("backend", "mesh_name"), [backend_param("cpu", "8"), backend_param("gpu", "2")]
)
def test_vocab_parallel_cross_entropy_at_large_logits(backend, mesh_name):
    """Logits offset by 1e7 with the vocabulary split: the slices' statistics combine
    without lse's rounding, so the gradient matches float64 as at offset 0, and the loss
    to float32's precision of the loss itself."""
    mesh = make_mesh(backend, mesh_name, (AxisType.Auto,))
    noise = jax.random.normal(key_for("vocab", "large"), (VOCAB_ROWS, VOCAB), jnp.float32)
    x = np.asarray(1e7 + 3.0 * noise, np.float32)
    labels = (np.arange(VOCAB_ROWS) * 37) % VOCAB
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "a")))
    ls = jax.device_put(labels, NamedSharding(mesh, P()))

    def rows(x, labels):
        return quack_jax.cross_entropy(x, labels, reduction="none")

    loss, grad = jax.device_get(jax.jit(jax.value_and_grad(lambda *a: jnp.sum(rows(*a))))(xs, ls))
    per_row = jax.device_get(jax.jit(rows)(xs, ls))
    x64 = x.astype(np.float64)
    top = x64.max(axis=-1, keepdims=True)
    p = np.exp(x64 - top) / np.sum(np.exp(x64 - top), axis=-1, keepdims=True)
    hit = np.arange(VOCAB) == labels[:, None]
    ref_rows = -np.log(p[hit])
    assert_close(grad, p - hit, p + p.max(axis=-1, keepdims=True), "float32", "dlogits")
    assert_close(per_row, ref_rows, 1.0 + ref_rows, "float32", "loss")
    assert_close(loss, ref_rows.sum(), 1.0 + ref_rows.sum(), "float32", "sum")


@pytest.mark.skipif(len(jax.devices()) < 8, reason="the guide's mesh needs 8 devices")
def test_guide_sharded_train_step():
    """The sharded train step of the sharding guide runs as written, its loss equals the
    loss of the same step on one device, and the logits are never gathered (no
    all-gather of a vocab-sized block)."""
    guide = pathlib.Path(__file__).parent.parent / "docs" / "guides" / "sharding.md"
    cells = [c.split("```", 1)[0] for c in guide.read_text().split("```{code-cell} ipython3\n")]
    scope = {}
    exec(compile("".join(cells[1:3]), str(guide), "exec"), scope)
    step, params, h, labels = (scope[k] for k in ("train_step", "params", "h", "labels"))
    assert np.isfinite(float(scope["loss"]))
    text = step.lower(params, h, labels).compile().as_text()
    vocab_blocks = {str(scope["vocab"]), str(scope["vocab"] // 4)}
    for line in text.splitlines():
        if "all-gather(" in line:
            assert not vocab_blocks & set(re.findall(r"\d+", line.split("all-gather(")[0])), line
    one_device = jax.devices()[0]
    local = jax.device_put((params, h, labels), one_device)
    loss, ref = jax.device_get((step(params, h, labels)[0], step(*local)[0]))
    # bfloat16 logits, summed over d in another order
    assert_close(loss, ref, np.abs(ref), "bfloat16", "the guide's loss")


# -- every op's sharded properties: the adapters of ops.py ---------------------------------

CONTRACT = [
    pytest.param(b, op, marks=[pytest.mark.gpu] if b == "gpu" else [], id=f"{b}-{op.name}")
    for b in ("cpu", "gpu")
    for op in ops.OPS
]
CONTRACT_ROWS = 16
CONTRACT_MESH = {"cpu": "8", "gpu": "2"}


def contract_args(backend, op, what):
    """The op's arguments (numpy) and the mesh: the per-row ones split over its axis."""
    mesh = make_mesh(backend, CONTRACT_MESH[backend])
    a = op.draw((CONTRACT_ROWS,), op.n[backend], "float32", key_for(what, op.name))
    specs = {k: P("a") if k in op.rows else P() for k in a}
    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in a.items()}
    return mesh, a, specs, placed


def both(op):
    return lambda a: [ops.results(op, options)(a) for options in (False, True)]


@pytest.mark.parametrize(("backend", "op"), CONTRACT)
def test_rows_sharded_jit_matches_the_reference(backend, op):
    """The rows split across the devices under jit: the float64 reference's values and
    gradients, and the per-row results split as the rows."""
    _, a, _, placed = contract_args(backend, op, "sharded jit")
    got = run_launching(backend, both(op), placed)
    shared = {f"d{p}" for p in op.params}
    for options, results in zip((False, True), got, strict=True):
        ops.check(op, results, op.reference(a, options), f"rows split options={options}")
        for k, v in results.items():
            if v.ndim and k not in shared:
                assert full(v.sharding.spec, v.ndim)[0] == "a", (k, v.sharding)


@pytest.mark.parametrize(("backend", "op"), CONTRACT)
def test_shard_map_matches_the_reference(backend, op):
    """The op on each device's rows inside shard_map: each device's results those of the
    float64 reference of its rows; the gradients of the shared arguments (which
    shard_map sums over the devices) and the scalar losses (summed here) the sums of the
    devices'."""
    mesh, a, specs, placed = contract_args(backend, op, "shard_map")
    local = {k: v[: CONTRACT_ROWS // mesh.size] if k in op.rows else v for k, v in a.items()}
    shapes = jax.eval_shape(both(op), ops.structs(local))
    shared = {f"d{p}" for p in op.params}
    out_specs = [
        {k: P() if k in shared or not s.shape else P("a") for k, s in r.items()} for r in shapes
    ]

    def per_device(a):
        return [
            {k: jax.lax.psum(v, "a") if not v.shape else v for k, v in r.items()}
            for r in both(op)(a)
        ]

    f = jax.shard_map(per_device, mesh=mesh, in_specs=(specs,), out_specs=out_specs)
    got = run_launching(backend, f, placed)
    share = CONTRACT_ROWS // mesh.size
    parts = [slice(i * share, (i + 1) * share) for i in range(mesh.size)]
    for options, results in zip((False, True), got, strict=True):
        want = ops.reference_of_parts(op, a, options, parts, "concat")
        ops.check(op, results, want, f"shard_map options={options}")


# -- linear_cross_entropy split over rows and vocabulary (CPU) -------------------------------

# mesh shape and axes; the specs of h and the weight; whether the weight is (V, d)
LCE_DATA_MODEL = ((2, 4), ("data", "model"))
LCE_LAYOUTS = {
    "vocab-8": ((8,), ("m",), P(), P(None, "m"), False),
    "rows-8": ((8,), ("d",), P("d"), P(), False),
    "2x4": (*LCE_DATA_MODEL, P("data"), P(None, "model"), False),
    "2x4-transposed": (*LCE_DATA_MODEL, P("data"), P("model", None), True),
}
LCE_OPTIONS = {
    "mean": dict(reduction="mean"),
    "none": dict(reduction="none"),
    "smoothing-zloss-lse": dict(
        reduction="mean", label_smoothing=0.1, z_loss=0.01, return_lse=True
    ),
}


def count_all_reduces_of_no_logits(text, rows, d, v_local):
    """Assert that every all-reduce in the compiled ``text`` moves scalars, per-row
    vectors (of at most ``rows``, perhaps with a trailing 1) or bias gradients (of at
    most ``v_local``), (at most rows, d) blocks
    of dh (a chunk's, or the whole of a sum over vocabulary slices), or the weight
    gradient's local slice (either layout, or a vocabulary slice's share of it): never a
    (rows, V) block. Returns how many there are."""
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
                (len(per_row) <= 1 and sum(per_row) <= max(rows, v_local))
                or (len(shape) == 2 and shape[0] <= rows and shape[1] == d)
                or (len(shape) == 2 and d in shape and max(shape) <= v_local)
                or shape in ((d, v_local), (v_local, d), (v_local,))
            ), line
    return reduces


LCE_ROWS = 64
# the schedules of the cases below, as (chunk, vocabulary): chunks of 12 rows (per-row
# losses: 8 vocabulary slices of 1000, 7 of 128 and then 104), one chunk (one slice),
# and 4 chunks of 1024 (4 equal slices)
LCE_SCHEDULES = {"chunks": (12, 1000), "one": (LCE_ROWS, 1000), "equal": (16, 1024)}
# each option on at least three layouts, in chunks, on meshes of Explicit axes
# (make_mesh's default) but one of Auto axes; per-row losses also in one slice, and in
# equal slices on meshes of Auto axes, where XLA places the kept logits
LCE_CASES = [
    ("vocab-8", "mean", AxisType.Explicit, "chunks"),
    ("vocab-8", "smoothing-zloss-lse", AxisType.Explicit, "chunks"),
    ("rows-8", "none", AxisType.Explicit, "chunks"),
    ("rows-8", "smoothing-zloss-lse", AxisType.Explicit, "chunks"),
    ("2x4", "mean", AxisType.Explicit, "chunks"),
    ("2x4", "none", AxisType.Explicit, "chunks"),
    ("2x4", "smoothing-zloss-lse", AxisType.Explicit, "chunks"),
    ("2x4-transposed", "none", AxisType.Explicit, "chunks"),
    ("2x4-transposed", "mean", AxisType.Auto, "chunks"),
    ("vocab-8", "smoothing-zloss-lse", AxisType.Explicit, "one"),
    ("rows-8", "none", AxisType.Explicit, "one"),
    ("2x4", "none", AxisType.Explicit, "one"),
    ("2x4-transposed", "smoothing-zloss-lse", AxisType.Auto, "one"),
    ("vocab-8", "none", AxisType.Auto, "equal"),
    ("2x4-transposed", "smoothing-zloss-lse", AxisType.Auto, "equal"),
    ("2x4", "none", AxisType.Auto, "equal"),
]


def lce_sharded(layout, option, axis_type, schedule):
    """linear_cross_entropy's loss_and_grads on the host devices with ``layout``, checked
    against float64 and for the gradients split as their arguments: the compiled text,
    the rows, the local vocabulary."""
    shape, axes, h_spec, w_spec, transpose = LCE_LAYOUTS[layout]
    mesh = jax.make_mesh(
        shape, axes, axis_types=(axis_type,) * len(axes), devices=jax.devices("cpu")[:8]
    )
    (chunk, v), t, d = LCE_SCHEDULES[schedule], LCE_ROWS, lce.HIDDEN
    opts = dict(LCE_OPTIONS[option], transpose_weight=transpose, chunk_size=chunk)
    args = lce.draw(t, d, v, transpose=transpose, ignored=0.1)
    vocab_axis = w_spec[0 if transpose else 1] if len(w_spec) else None
    row_axis = h_spec[0] if len(h_spec) else None
    rows = P(row_axis)
    specs = (h_spec, w_spec, P(vocab_axis), rows, rows, rows)
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs, strict=True)]
    f = jax.jit(lce.loss_and_grads(**opts))
    text = f.lower(*sharded).compile().as_text()
    out, grads = f(*sharded)
    lce.assert_matches(out, grads, args, opts)
    for k, x in zip(lce.ALL, sharded, strict=False):
        assert grads[k].sharding.is_equivalent_to(x.sharding, x.ndim), k
    return text, t, v // (mesh.shape[vocab_axis] if vocab_axis else 1)


@pytest.mark.parametrize("layout,option,axis_type,schedule", LCE_CASES)
def test_linear_cross_entropy_sharded_matches_float64_without_gathering(
    layout, option, axis_type, schedule
):
    """linear_cross_entropy with the rows, the vocabulary or both split on the host
    devices (either weight layout): float64's values and gradients, the gradients split
    as their arguments, and no logits gathered or all-reduced."""
    text, t, v_local = lce_sharded(layout, option, axis_type, schedule)
    assert not [c for c in GATHERS if c in text], layout
    assert count_all_reduces_of_no_logits(text, t, lce.HIDDEN, v_local) > 0


def test_unequal_slices_where_xla_splits_the_vocabulary_gather_their_kept_logits():
    """Per-row losses over unequal vocabulary slices (1000 in chunks of 12 of 64 rows:
    8 slices, 7 of 128 and then 104, the last 4 kept, as 8 equal parts of 1000 are not
    8 wide), on a mesh of Auto axes that splits the vocabulary: the sharding rule cannot
    tie the kept slices' split to the weight's, so XLA gathers their logits across the
    vocabulary's devices; the results still match float64. (Equal slices, one slice and
    Explicit axes gather nothing: the test above.)"""
    text, *_ = lce_sharded("vocab-8", "none", AxisType.Auto, "chunks")
    gathers = [line for line in text.splitlines() if "all-gather(" in line]
    assert len(gathers) == 4, gathers
    assert sum("[64,128]" in g for g in gathers) == 3 and sum("[64,104]" in g for g in gathers) == 1


# rows and row length that 8 host devices or two GPUs do not divide
UNEVEN = {"cpu": ("8", (6,), 100), "gpu": ("2", (5,), 7)}  # (mesh, rows, n): odd on 2


@pytest.mark.parametrize("split", ["rows", "reduced"])
@pytest.mark.parametrize("backend", backends())
def test_uneven_split_is_gathered_and_correct(backend, split):
    """A mesh axis that does not divide the axis it splits (rows or the reduced axis, set
    by a sharding constraint inside jit) is gathered first, and the results are right."""
    mesh_name, lead, n = UNEVEN[backend]
    mesh = make_mesh(backend, mesh_name, (AxisType.Auto,))
    spec = P("a", None) if split == "rows" else P(None, "a")
    for op, loss in sharding_losses(n).items():

        def constrained(x, w, labels, loss=loss):
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
            return loss(x, w, labels)

        x, w, labels = inputs(backend, op, "float32", lead, n)
        got = jax.jit(jax.value_and_grad(constrained, argnums=(0, 1)))(x, w, labels)
        want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w, labels)
        assert_matches(got, want, "float32", f"{op} uneven {split} split")


def test_gpu_lengths_are_built():
    """The row lengths that the gpu tests run each op at, and those its kernels see on
    each GPU (half of cross-entropy's vocabulary; the vocab-parallel tests' whole and
    half), are among those its family's SPEC builds: prebuild builds no others."""
    found = specs()
    for op in OPS:
        family = next(name for name in found if op.startswith(name))
        lengths = gpu_lengths(family)
        assert {size("gpu", op), UNEVEN["gpu"][2]} <= lengths, op
    ce = gpu_lengths("cross_entropy")
    assert {SIZES["gpu"]["cross_entropy"] // 2, VOCAB, VOCAB // 2} <= ce


@pytest.mark.parametrize("layout", ["vocab-8", "2x4", "2x4-transposed"])
def test_linear_token_loss_vocab_split_matches_one_device(layout):
    """linear_token_loss with the vocabulary (and rows) split on the host devices: each
    device's slice of each chunk combines the row statistics, so that every device takes
    the same per-token cotangents; the loss and the gradients of h, the weight and a
    per-token argument are those on one device, and no logits are gathered."""
    shape, axes, h_spec, w_spec, transpose = LCE_LAYOUTS[layout]
    mesh = jax.make_mesh(shape, axes, devices=jax.devices("cpu")[:8])
    t, d, v = 64, lce.HIDDEN, lce.V
    h, w, _, labels, advantage, _ = lce.draw(t, d, v, transpose=transpose, ignored=0.1)

    def per_token(logp, entropy, advantage):
        ratio = jnp.exp(logp + 6.0)
        return (
            -jnp.minimum(ratio * advantage, jnp.clip(ratio, 0.8, 1.2) * advantage) + 0.01 * entropy
        )

    def loss(h, w, advantage):
        return quack_jax.linear_token_loss(
            h,
            w,
            labels,
            per_token,
            advantage,
            transpose_weight=transpose,
            chunk_size=12,
            temperature=0.7,
            ignore_index=lce.IGNORE,
            precision="highest",
        )

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    row_axis = h_spec[0] if len(h_spec) else None
    specs = (h_spec, w_spec, P(row_axis))
    args = (h, w, advantage)
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs, strict=True)]
    text = f.lower(*sharded).compile().as_text()
    assert not [c for c in GATHERS if c in text], layout
    value, grads = f(*sharded)
    want, want_grads = f(*args)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for got, ref, x in zip(grads, want_grads, sharded, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())
        assert got.sharding.is_equivalent_to(x.sharding, x.ndim)
