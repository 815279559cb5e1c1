"""The partitioning rules on two sm_90 GPUs: every op and its gradient, with the rows or
the reduced axis split across the GPUs, against the same function on one GPU.

With the rows split, each GPU runs the kernels on its rows, so the results are the same
bits as on one GPU (the weight gradient is summed in another order). With the reduced
axis split, cross-entropy runs its kernels on each GPU's slice of the vocabulary and
softmax and the norms run the XLA reference on theirs; the results agree to the dtype's
tolerance (XLA on the GPU keeps excess precision inside its fusions: it drops the
rounding of the bfloat16 cotangent that the kernels read from memory, which moves the
norms' weight gradient by up to a bfloat16 rounding). Neither moves rows between the GPUs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import TOL, key_for, sharding_losses
from conftest import kernel_devices
from jax.sharding import NamedSharding, PartitionSpec

import quack_jax
from quack_jax import _ffi

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("poison_outputs"),
    pytest.mark.skipif(len(kernel_devices()) < 2, reason="needs two sm_90 GPUs"),
]

ROWS = 2000
SIZES = {"softmax": 5000, "norm": 4096, "cross_entropy": 32000}
DTYPES = ("float32", "bfloat16")
GATHERS = ("all-gather", "all-to-all", "reduce-scatter", "collective-permute")


def size(op):
    return next(n for prefix, n in SIZES.items() if prefix in op)


def inputs(op, dtype):
    n = size(op)
    kx, kl = jax.random.split(key_for(op, dtype))
    x = (3.0 * jax.random.normal(kx, (ROWS, n), jnp.float32)).astype(dtype)
    labels = jax.random.randint(kl, (ROWS,), 0, n).at[::7].set(-100)
    return x, jnp.linspace(0.5, 1.5, n), labels


def _per_row_loss(x, labels):
    return jnp.sum(quack_jax.cross_entropy(x, labels, reduction="none"))


def prebuild_cases():
    """(fn, shape-dtype structs) for the kernels these tests launch: each loss at its
    shape (the rows split keeps the kernels' n), and the per-row cross-entropy that runs
    on half the vocabulary."""
    labels = jax.ShapeDtypeStruct((ROWS,), jnp.int32)
    for dtype in DTYPES:
        for op in sharding_losses(1):
            n = size(op)
            x, w = jax.ShapeDtypeStruct((ROWS, n), dtype), jax.ShapeDtypeStruct((n,), jnp.float32)
            yield jax.grad(sharding_losses(n)[op], argnums=(0, 1)), (x, w, labels)
        half = jax.ShapeDtypeStruct((ROWS, SIZES["cross_entropy"] // 2), dtype)
        yield jax.grad(_per_row_loss), (half, labels)


@pytest.mark.parametrize("split", ["rows", "reduced"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(sharding_losses(1)))
def test_two_gpus_match_one(op, dtype, split):
    mesh = jax.make_mesh((2,), ("g",), devices=kernel_devices()[:2])
    rows = split == "rows"
    x, w, labels = inputs(op, dtype)
    specs = (
        (PartitionSpec("g", None), PartitionSpec(), PartitionSpec("g"))
        if rows
        else (PartitionSpec(None, "g"), PartitionSpec("g"), PartitionSpec())
    )
    sharded = [
        jax.device_put(a, NamedSharding(mesh, p))
        for a, p in zip((x, w, labels), specs, strict=True)
    ]
    one = jax.device_put((x, w, labels), kernel_devices()[0])
    f = jax.jit(jax.value_and_grad(sharding_losses(size(op))[op], argnums=(0, 1)))
    text = f.lower(*sharded).compile().as_text()
    assert not [c for c in GATHERS if c in text], f"{op} moves rows between the GPUs"
    if rows or "cross_entropy" in op:
        assert _ffi.TARGET in text, f"{op} runs without kernels"
    (value, (gx, gw)), (ref, (rgx, rgw)) = f(*sharded), f(*one)
    assert gx.sharding.spec == specs[0]
    gx, rgx, gw, rgw = (np.asarray(a, np.float64) for a in (gx, rgx, gw, rgw))
    # the loss sums ~10^7 terms in another order; in bfloat16 with the reduced axis split,
    # XLA also multiplies y unrounded (excess precision), the kernels' y is rounded
    bf16_split = dtype == "bfloat16" and not rows
    np.testing.assert_allclose(value, ref, rtol=TOL[dtype] if bf16_split else 1e-4, atol=1e-2)
    if rows:
        np.testing.assert_array_equal(gx, rgx)
    else:  # atol: elements that cancel (log-softmax's t - p * sum(t))
        tol = TOL[dtype]
        np.testing.assert_allclose(gx, rgx, rtol=tol, atol=10 * tol * np.abs(rgx).max())
    tol = 1e-4 if rows else TOL[dtype]
    np.testing.assert_allclose(gw, rgw, rtol=tol, atol=tol * np.abs(rgw).max())
