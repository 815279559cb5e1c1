"""What linear + cross-entropy builds and tests (``_spec.OpSpec``): it launches the
cross-entropy kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._spec import OpSpec, Shapes
from .api import linear_cross_entropy, linear_token_logprobs


def _lowerings(op: str, dtype: str, n: int, packaged: bool):
    """The value and gradients over two whole chunks and a part, with the weight as
    (d, V) and as (V, d) (``packaged``: (d, V) only): of the mean loss, or of the sum of
    logp and the entropy (linear_token_logprobs)."""
    t, d, chunk = 300, 64, 128
    h, labels = jax.ShapeDtypeStruct((t, d), dtype), jax.ShapeDtypeStruct((t,), "int32")
    for transpose in (False,) if packaged else (False, True):
        w = jax.ShapeDtypeStruct((n, d) if transpose else (d, n), dtype)

        def loss(h, w, labels, transpose=transpose):
            def f(h, w):
                options = dict(transpose_weight=transpose, chunk_size=chunk)
                if op == "linear_cross_entropy":
                    return linear_cross_entropy(h, w, labels, **options)
                logp, ent = linear_token_logprobs(h, w, labels, return_entropy=True, **options)
                return jnp.sum(logp + ent)

            return jax.value_and_grad(f, argnums=(0, 1))(h, w)

        yield loss, (h, w, labels)


SPEC = OpSpec(
    ops=("linear_cross_entropy", "linear_token_logprobs"),
    configs=(),  # the cross-entropy kernels
    sizes="vocab",
    lowerings=_lowerings,
    tests={
        "cpu": Shapes(rows=(300,), sizes=(1000,), dtypes=("float32", "bfloat16")),
        "gpu": Shapes(
            rows=(300,),
            sizes=(32000, 50257, 128256, 152064, 256000),
            dtypes=("bfloat16", "float32"),
        ),
    },
)
