"""What linear + cross-entropy builds and tests (``_spec.OpSpec``): it launches the
cross-entropy kernels."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from .._spec import OpSpec, Shapes
from .api import linear_cross_entropy, linear_token_logprobs, linear_token_loss
from .options import default_slice_counts

# the options that choose the cross-entropy kernels' variants: the mean loss (its
# gradient from the forward) or per-row losses (a forward and a backward kernel), with
# label smoothing or not, with a softcap or not
VARIANTS = tuple(
    dict(reduction=r, label_smoothing=s, logit_softcap=c)
    for r, s, c in itertools.product(("mean", "none"), (0.0, 0.1), (None, 20.0))
)


# the per-row calls of the tests, as (rows, vocabulary, chunk), whose vocabulary slices
# the GPU's kernels are built for, each with the default options and SCHEDULE_OPTIONS
# and a bias: the schedules (one slice, 8 equal slices, unequal slices of a misaligned
# vocabulary, the last one padded, and chunks of rows), then 7 rows in chunks of 1, 37
# in chunks of 4, and the special values' vocabulary
SCHEDULES = ((37, 1000, 37), (37, 16000, 8), (37, 9973, 3), (37, 32, 8))
PER_ROW_TESTS = (*SCHEDULES, (7, 1000, 1), (37, 1000, 4), (37, 50257, 8))
SCHEDULE_OPTIONS = dict(reduction="none", return_lse=True, label_smoothing=0.1, z_loss=1e-4)
SMALL_VOCAB = 1000
# the options of the tests' linear_token_logprobs calls
TOKEN_OPTIONS = dict(temperature=0.7, logit_softcap=20.0)


def _lowerings(op: str, dtype: str, n: int, packaged: bool):
    """The value and gradients over two whole chunks and a part, with the weight as
    (d, V) and as (V, d): of the loss with each of ``VARIANTS``, of the sum of logp and
    the entropy (linear_token_logprobs), or of a token loss of both (linear_token_loss,
    the same kernels), with the default options and ``TOKEN_OPTIONS``; at the smaller
    cases' vocabulary also ``PER_ROW_TESTS``. ``packaged``: the mean loss, or those
    sums with the default options, with the weight as (d, V); and the per-row losses and
    those sums over each count of vocabulary slices that the default chunk gives."""
    t, d, chunk = 300, 64, 128
    h, labels = jax.ShapeDtypeStruct((t, d), dtype), jax.ShapeDtypeStruct((t,), "int32")
    variants = VARIANTS[:1] if packaged else VARIANTS
    for transpose in (False,) if packaged else (False, True):
        w = jax.ShapeDtypeStruct((n, d) if transpose else (d, n), dtype)
        token_options = ({},) if packaged else ({}, TOKEN_OPTIONS)
        for options in variants if op == "linear_cross_entropy" else token_options:
            options = dict(options, transpose_weight=transpose, chunk_size=chunk)
            yield _value_and_grads(op, options), (h, w, labels)
    if op == "linear_cross_entropy" and n == SMALL_VOCAB and not packaged:
        yield from _schedule_lowerings(dtype, d)
    if packaged and op != "linear_token_loss":
        yield from _slice_lowerings(op, dtype, n, d)


def _value_and_grads(op: str, options: dict):
    """The value and gradients for h and the weight of ``op`` with ``options``: of the
    loss (summed where per-row), of the sum of logp and the entropy
    (linear_token_logprobs), or of a token loss of both (linear_token_loss)."""

    def loss(h, w, labels):
        def f(h, w):
            if op == "linear_cross_entropy":
                loss = linear_cross_entropy(h, w, labels, **options)
                return jnp.sum(loss) if loss.ndim else loss
            if op == "linear_token_loss":
                return linear_token_loss(h, w, labels, _token_loss, **options)
            logp, ent = linear_token_logprobs(h, w, labels, return_entropy=True, **options)
            return jnp.sum(logp + ent)

        return jax.value_and_grad(f, argnums=(0, 1))(h, w)

    return loss


def _slice_lowerings(op: str, dtype: str, n: int, d: int):
    """The value and gradients of the per-row losses (linear_cross_entropy), or of the sum
    of logp and the entropy (linear_token_logprobs), over each of
    ``default_slice_counts(n)`` vocabulary slices but one, with the default options."""
    chunk = 128
    options = dict(chunk_size=chunk) | (
        {"reduction": "none"} if op == "linear_cross_entropy" else {}
    )
    for count in default_slice_counts(n, jnp.dtype(dtype).itemsize)[1:]:
        h = jax.ShapeDtypeStruct((count * chunk, d), dtype)
        labels = jax.ShapeDtypeStruct((count * chunk,), "int32")
        w = jax.ShapeDtypeStruct((d, n), dtype)
        yield _value_and_grads(op, options), (h, w, labels)


def _schedule_lowerings(dtype: str, d: int):
    """The value and gradients of ``PER_ROW_TESTS``' per-row losses and lse, either
    layout, with the default options and with ``SCHEDULE_OPTIONS``."""
    cases = itertools.product(PER_ROW_TESTS, (False, True), ({}, SCHEDULE_OPTIONS))
    for (t, v, chunk), transpose, extra in cases:
        h = jax.ShapeDtypeStruct((t, d), dtype)
        labels = jax.ShapeDtypeStruct((t,), "int32")
        w = jax.ShapeDtypeStruct((v, d) if transpose else (d, v), dtype)
        bias = jax.ShapeDtypeStruct((v,), dtype)
        options = {"reduction": "none", "return_lse": True} | extra
        options |= dict(transpose_weight=transpose, chunk_size=chunk)

        def loss(h, w, bias, labels, options=options):
            def f(h, w, bias):
                out = linear_cross_entropy(h, w, labels, bias=bias, **options)
                return jnp.sum(out[0]) + jnp.sum(out[1])

            return jax.value_and_grad(f, argnums=(0, 1, 2))(h, w, bias)

        yield loss, (h, w, bias, labels)


def _token_loss(logp, entropy):
    return logp + 0.01 * entropy


SPEC = OpSpec(
    ops=("linear_cross_entropy", "linear_token_logprobs", "linear_token_loss"),
    configs=(),  # the cross-entropy kernels
    sizes="vocab",
    lowerings=_lowerings,
    tests={
        "cpu": Shapes(rows=(300,), sizes=(1000,), dtypes=("float32", "bfloat16")),
        "gpu": Shapes(
            rows=(300,),
            sizes=(32000, 50257, 128256, 152064, 256000),
            dtypes=("bfloat16", "float32"),
            others=(1000,),  # the smaller cases' vocabulary
        ),
    },
)
