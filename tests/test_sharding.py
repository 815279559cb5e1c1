"""Sharded use on 8 host devices, through the XLA fallback, which goes through the same
partitioning rules as the kernels: rows split across devices, the reduced axis split
across devices (every op; cross-entropy's vocabulary with all its options), shard_map,
and the README's sharded train step. ``test_gpu_sharding.py`` runs the kernels on two
GPUs."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import sharding_losses
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import quack_jax


def mesh():
    return jax.make_mesh((8,), ("rows",), devices=jax.devices("cpu")[:8])


def test_sharded_jit_matches_unsharded():
    x = jax.random.normal(jax.random.key(0), (64, 300), jnp.float32)
    sharded = jax.device_put(x, NamedSharding(mesh(), PartitionSpec("rows")))

    def loss(x):
        return jnp.sum(quack_jax.log_softmax(x) * jnp.linspace(-1.0, 1.0, 300))

    value, grad = jax.jit(jax.value_and_grad(loss))(sharded)
    ref_value, ref_grad = jax.value_and_grad(loss)(x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-4)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert grad.sharding.spec[0] == "rows"


def test_shard_map_matches_unsharded():
    x = jax.random.normal(jax.random.key(1), (64, 300), jnp.bfloat16)
    spec = PartitionSpec("rows")
    sharded = jax.device_put(x, NamedSharding(mesh(), spec))
    f = jax.jit(jax.shard_map(quack_jax.softmax, mesh=mesh(), in_specs=spec, out_specs=spec))
    np.testing.assert_array_equal(f(sharded), quack_jax.softmax(x))


# -- partitioning rules: rows split across devices, no collective on the activations ----

MESHES = {"8": ((8,), ("a",)), "2x4": ((2, 4), ("a", "b")), "4x2": ((4, 2), ("a", "b"))}
GATHERS = ("all-gather", "all-to-all", "reduce-scatter", "collective-permute")
N = 96


def _mesh(name):
    shape, axes = MESHES[name]
    return jax.make_mesh(shape, axes, devices=jax.devices("cpu")[:8])


def _inputs():
    x = jax.random.normal(jax.random.key(3), (8, 4, N), jnp.float32)
    w = jnp.linspace(0.5, 1.5, N)
    labels = (jnp.arange(32).reshape(8, 4) * 7) % N
    return x, w, labels.at[0, 0].set(-100)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("op", list(sharding_losses(N)))
def test_rows_sharded_run_on_their_shard_without_gathering(op, mesh_name):
    """Forward and gradients (x and weight) on rows sharded over every mesh axis equal the
    unsharded ones, and the compiled program moves no activations between devices."""
    mesh = _mesh(mesh_name)
    spec = PartitionSpec("a", "b") if len(mesh.axis_names) == 2 else PartitionSpec("a")
    x, w, labels = _inputs()
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec, None)))
    ls = jax.device_put(labels, NamedSharding(mesh, spec))
    f = jax.jit(jax.value_and_grad(sharding_losses(N)[op], argnums=(0, 1)))
    text = f.lower(xs, w, ls).compile().as_text()
    assert not [c for c in GATHERS if c in text], f"{op} on mesh {mesh_name} moves activations"
    (value, (gx, gw)), (ref, (rgx, rgw)) = f(xs, w, ls), f(x, w, labels)
    np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(gx, rgx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw, rgw, rtol=1e-5, atol=1e-5)
    assert gx.sharding.spec[: len(spec)] == tuple(spec)


# the reduced axis split over the mesh's last axis, and the rows over the others
REDUCED = {
    "8": PartitionSpec(None, None, "a"),
    "2x4": PartitionSpec("a", None, "b"),
    "4x2": PartitionSpec(None, "a", "b"),
}


def _per_row_collectives_only(text, mesh, spec):
    """Assert the compiled program gathers nothing and all-reduces only per-row values
    (at most one per row) or a slice of the weight gradient (summed over the rows)."""
    assert not [c for c in GATHERS if c in text]
    cols = N // mesh.shape[spec[-1]]
    for line in text.splitlines():
        if "all-reduce(" in line:
            shape = line.split("=")[1].split("all-reduce(")[0]
            dims = [int(d) for d in re.findall(r"\d+", shape.split("[", 1)[-1].split("]")[0])]
            assert np.prod(dims) <= 32 or dims == [cols], line


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("op", list(sharding_losses(N)))
def test_reduced_axis_sharded_combines_per_row_statistics(op, mesh_name):
    """Forward and gradients with the reduced axis split across devices (and the rows
    across the others) equal the unsharded ones; the devices exchange per-row statistics
    (max, sums) and the weight gradient, never rows."""
    mesh = _mesh(mesh_name)
    spec = REDUCED[mesh_name]
    x, w, labels = _inputs()
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    ws = jax.device_put(w, NamedSharding(mesh, PartitionSpec(spec[-1])))
    ls = jax.device_put(labels, NamedSharding(mesh, PartitionSpec(*spec[:-1])))
    f = jax.jit(jax.value_and_grad(sharding_losses(N)[op], argnums=(0, 1)))
    _per_row_collectives_only(f.lower(xs, ws, ls).compile().as_text(), mesh, spec)
    (value, (gx, gw)), (ref, (rgx, rgw)) = f(xs, ws, ls), f(x, w, labels)
    # the loss sums ~3000 terms of size ~5 in another order: atol is float32 rounding
    np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-2)
    np.testing.assert_allclose(gx, rgx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw, rgw, rtol=1e-5, atol=1e-5)
    assert gx.sharding.spec == spec


def test_reduced_axis_sharded_in_explicit_mode():
    """With explicit sharding (the mesh axes in the arrays' types) every op takes the
    reduced axis split, and its results keep the split in their types."""
    mesh = jax.make_mesh(
        (2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices("cpu")[:8]
    )
    spec = REDUCED["2x4"]
    x, w, labels = _inputs()
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    ws = jax.device_put(w, NamedSharding(mesh, PartitionSpec("b")))
    ls = jax.device_put(labels, NamedSharding(mesh, PartitionSpec("a")))
    with jax.set_mesh(mesh):
        for op, loss in sharding_losses(N).items():
            f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            _per_row_collectives_only(f.lower(xs, ws, ls).compile().as_text(), mesh, spec)
            value, (gx, gw) = f(xs, ws, ls)
            ref, (rgx, rgw) = jax.value_and_grad(loss, argnums=(0, 1))(x, w, labels)
            np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-2, err_msg=op)
            np.testing.assert_allclose(gx, rgx, rtol=1e-5, atol=1e-6, err_msg=op)
            np.testing.assert_allclose(gw, rgw, rtol=1e-5, atol=1e-5, err_msg=op)
            assert jax.typeof(gx).sharding.spec == spec, op


def test_shard_map_of_every_op_matches_unsharded():
    mesh = _mesh("2x4")
    spec = PartitionSpec("a", "b")
    x, w, labels = _inputs()
    for op, loss in sharding_losses(N).items():

        def per_shard(x, w, labels, loss=loss):
            value, grads = jax.value_and_grad(loss, argnums=(0, 1))(x, w, labels)
            return jax.lax.psum(value, ("a", "b")), grads

        f = jax.jit(
            jax.shard_map(
                per_shard,
                mesh=mesh,
                in_specs=(PartitionSpec(*spec, None), PartitionSpec(), spec),
                out_specs=(PartitionSpec(), (PartitionSpec(*spec, None), PartitionSpec())),
            )
        )
        if op == "cross_entropy_mean":
            continue  # a mean over each shard's rows is not the global mean
        value, (gx, gw) = f(
            jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec, None))),
            jax.device_put(w, NamedSharding(mesh, PartitionSpec())),
            jax.device_put(labels, NamedSharding(mesh, spec)),
        )
        ref, (rgx, rgw) = jax.value_and_grad(loss, argnums=(0, 1))(x, w, labels)
        np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-3, err_msg=op)
        np.testing.assert_allclose(gx, rgx, rtol=1e-5, atol=1e-6, err_msg=op)
        np.testing.assert_allclose(gw, rgw, rtol=1e-5, atol=1e-5, err_msg=op)


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
@pytest.mark.parametrize(
    "options",
    [
        dict(reduction="mean"),
        dict(reduction="none", return_lse=True),
        dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3, logit_softcap=5.0),
    ],
    ids=["mean", "rows-lse", "sum-all-options"],
)
def test_vocab_parallel_cross_entropy_combines_per_row_statistics(mesh_shape, options):
    """The vocabulary split across devices (a tensor-parallel LM head), with the rows
    split too on the 2-D mesh: the loss and its gradient equal the unsharded ones, and the
    devices exchange only per-row values (no gather; every all-reduce is of at most one
    value per row)."""
    axes = ("v",) if len(mesh_shape) == 1 else ("r", "v")
    mesh = jax.make_mesh(
        mesh_shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=jax.devices("cpu")[:8]
    )
    rows, vocab = 16, 400
    x = 3.0 * jax.random.normal(jax.random.key(5), (rows, vocab), jnp.float32)
    labels = ((jnp.arange(rows) * 37) % vocab).at[0].set(-100).at[1].set(vocab + 3)
    row_spec = "r" if len(axes) == 2 else None
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec(row_spec, "v")))
    ls = jax.device_put(labels, NamedSharding(mesh, PartitionSpec(row_spec)))

    def loss(x, labels):
        out = quack_jax.cross_entropy(x, labels, **options)
        return jnp.nansum(out[0] + out[1]) if options.get("return_lse") else jnp.nansum(out)

    f = jax.jit(jax.value_and_grad(loss))
    text = f.lower(xs, ls).compile().as_text()
    assert not [c for c in GATHERS if c in text]
    for line in text.splitlines():
        if "all-reduce(" in line:
            shape = line.split("=")[1].split("all-reduce(")[0]
            assert str(vocab) not in shape and str(vocab // 4) not in shape, line
    (value, grad), (ref, ref_grad) = f(xs, ls), f(x, labels)
    np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    if not options.get("return_lse"):  # there nansum drops row 1's NaN loss and cotangent
        assert np.isnan(np.asarray(grad)[1]).all() and (np.asarray(grad)[0] == 0).all()
    assert grad.sharding.spec == PartitionSpec(row_spec, "v")


@pytest.mark.skipif(len(jax.devices()) < 8, reason="the README's mesh needs 8 devices")
def test_readme_sharded_train_step():
    """The README's sharded train step runs as written, its loss equals the loss of the
    same step on one device, and the logits are never gathered (no all-gather of a
    vocab-sized block)."""
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Sharded training", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    step, params, h, labels = (scope[k] for k in ("train_step", "params", "h", "labels"))
    assert np.isfinite(float(scope["loss"]))
    text = step.lower(params, h, labels).compile().as_text()
    vocab_blocks = {str(scope["vocab"]), str(scope["vocab"] // 4)}
    for line in text.splitlines():
        if "all-gather(" in line:
            assert not vocab_blocks & set(re.findall(r"\d+", line.split("all-gather(")[0])), line
    one_device = jax.devices()[0]
    local = jax.device_put((params, h, labels), one_device)
    np.testing.assert_allclose(step(params, h, labels)[0], step(*local)[0], rtol=2e-2)


def test_uneven_split_is_gathered_and_correct():
    """A mesh axis that does not divide the axis it splits (rows or the reduced axis, set
    by a sharding constraint inside jit) is gathered first, and the results are right."""
    shape, axes = MESHES["8"]
    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:8])
    x = jax.random.normal(jax.random.key(9), (6, 100), jnp.float32)
    labels = jnp.arange(6) * 13
    for spec in (PartitionSpec("a", None), PartitionSpec(None, "a")):
        for op, loss in sharding_losses(100).items():

            def constrained(x, w, labels, loss=loss, spec=spec):
                x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
                return loss(x, w, labels)

            f = jax.value_and_grad(constrained, argnums=(0, 1))
            w = jnp.linspace(0.5, 1.5, 100)
            value, (gx, gw) = jax.jit(f)(x, w, labels)
            ref, (rgx, rgw) = jax.value_and_grad(loss, argnums=(0, 1))(x, w, labels)
            np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-3, err_msg=op)
            np.testing.assert_allclose(gx, rgx, rtol=1e-5, atol=1e-6, err_msg=op)
            np.testing.assert_allclose(gw, rgw, rtol=1e-5, atol=1e-5, err_msg=op)
