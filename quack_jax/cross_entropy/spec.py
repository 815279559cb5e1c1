"""What the cross-entropy family builds, benchmarks and tests (``_spec.OpSpec``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._spec import (
    FWD_BWD_COLUMNS,
    FWD_COLUMNS,
    TILINGS,
    Benchmark,
    Case,
    OpSpec,
    Shapes,
    Tuned,
)
from . import backward
from .api import cross_entropy, token_logprobs
from .config import CrossEntropyBackward, CrossEntropyForward
from .formulas import row_stats
from .options import CrossEntropyOptions
from .tilings import CE_BWD, CE_ENTROPY, CE_FWD, CE_GRAD


def _lowerings(op: str, dtype: str, n: int, packaged: bool):
    """cross_entropy: with each kernel variant (label smoothing or not, softcap or not;
    ``packaged``: neither), the gradient of the mean loss (one forward kernel that writes
    the gradient), and the per-row losses and lse under ``jax.vjp`` (forward and
    backward kernels). token_logprobs: under ``jax.vjp``, with the entropy, without
    a softcap (``packaged``), or with and without either."""
    args = (jax.ShapeDtypeStruct((8, n), dtype), jax.ShapeDtypeStruct((8,), "int32"))
    if op == "token_logprobs":
        for entropy in (True,) if packaged else (True, False):
            for softcap in (None,) if packaged else (None, 30.0):
                options = dict(return_entropy=entropy, logit_softcap=softcap)

                def rows(x, labels, options=options):
                    out, vjp = jax.vjp(lambda x: token_logprobs(x, labels, **options), x)
                    return out, vjp(out)

                yield rows, args
        return
    for smoothing in (0.0,) if packaged else (0.0, 0.1):
        for softcap in (None,) if packaged else (None, 30.0):
            options = dict(label_smoothing=smoothing, logit_softcap=softcap)

            def mean(x, labels, options=options):
                return jax.value_and_grad(lambda x: cross_entropy(x, labels, **options))(x)

            def rows(x, labels, options=options):
                def f(x):
                    return cross_entropy(x, labels, reduction="none", return_lse=True, **options)

                out, vjp = jax.vjp(f, x)
                return out, vjp(out)

            yield mean, args
            yield rows, args


def _benchmarks():
    """The mean loss over labels uniform in [0, N): forward, and ``jax.grad`` w.r.t. the
    logits; against optax's formulation (logsumexp - target logit) in float32. The
    arguments are the logits, the labels and dy (unused: the loss is a scalar)."""
    shapes = [(32768, 1024), (8192, 32000), (8192, 50257), (4096, 128256), (4096, 151936)]
    shapes += [(2048, 262144)]

    def quack(logits, labels):
        return cross_entropy(logits, labels)

    def xla(logits, labels):
        x = logits.astype(jnp.float32)
        target = jnp.take_along_axis(x, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(x, axis=-1) - target)

    def logits_labels(x, labels, dy):
        return x, labels

    return [
        Benchmark(
            "cross_entropy",
            shapes,
            quick_shapes=[(1024, 1024), (128, 32000)],
            arguments=lambda m, n, dtype: [((m, n), dtype), ((m,), "int32", n), ((m, n), dtype)],
            cases=[
                Case("quack_fwd", "quack_jax fwd", 1, quack, -1, kernel=True),
                Case("xla_fwd", "XLA fwd", 1, xla, -1),
                Case("quack_fwd_bwd", "quack_jax fwd+bwd", 2, jax.grad(quack), -1, kernel=True),
                Case("xla_fwd_bwd", "XLA fwd+bwd", 2, jax.grad(xla), -1),
            ],
            tuned=[
                Tuned("fwd", CE_FWD, 1, quack, logits_labels),
                Tuned("bwd", CE_BWD, 2, *_tuned_backward(entropy=False)),
                # the forward that also writes the gradient (a mean loss under jax.grad)
                Tuned("grad", CE_GRAD, 2, jax.grad(quack), logits_labels),
            ],
            columns=[*FWD_COLUMNS, *FWD_BWD_COLUMNS, TILINGS],
            footprint=4,
            latency_shapes=Benchmark.latency((32000, 128256, 256000)),  # vocabularies
        ),
        _token_logprobs_benchmark(),
    ]


def _tuned_backward(entropy, temperature=1.0):
    """The backward kernel alone, for the tuner: the function it times (every
    coefficient nonzero) and its operands from the benchmark's arguments."""

    def alone(logits, labels, shift, logsum, coefficient):
        coefficients = (coefficient,) * (3 + entropy)  # a, b, c and the entropy's d
        options = CrossEntropyOptions(temperature=temperature)
        return backward.backward.bind(
            logits,
            labels,
            shift,
            logsum,
            *coefficients,
            options=options,
            entropy=entropy,
            inplace=False,
        )[0]

    def operands(logits, labels, *_):
        shift, logsum = row_stats(logits.astype(jnp.float32) / temperature)
        return logits, labels, shift, logsum, jnp.full(shift.shape, 1.0 / shift.size, jnp.float32)

    return alone, operands


def _token_logprobs_benchmark(temperature=0.7):
    """token_logprobs with the entropy at a sampling temperature, against the plain-JAX
    formulation (log_softmax of logits / T, a gather, -sum(p * logp)) and against
    cross_entropy's per-row losses at the same temperature: forward, and ``jax.vjp``
    with cotangents for every output. Bytes: forward M*N*e (read the logits),
    fwd+bwd 3*M*N*e (the forward's read, the backward's read and write)."""

    def quack(logits, labels):
        return token_logprobs(logits, labels, temperature=temperature, return_entropy=True)

    def xla(logits, labels):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
        target = jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]
        return target, -jnp.sum(jnp.exp(logp) * logp, axis=-1)

    def ce(logits, labels):
        return cross_entropy(logits, labels, reduction="none", temperature=temperature)

    def vjp(fn):
        def f(logits, labels, g_logp, g_h):
            out, pullback = jax.vjp(lambda x: fn(x, labels), logits)
            return out, pullback((g_logp, g_h) if isinstance(out, tuple) else g_logp)

        return f

    return Benchmark(
        "token_logprobs",
        [(8192, 152064), (4096, 256000)],
        quick_shapes=[(128, 32000)],
        arguments=lambda m, n, dtype: [
            ((m, n), dtype),
            ((m,), "int32", n),
            ((m,), "float32"),
            ((m,), "float32"),
        ],
        cases=[
            Case("quack_fwd", "quack_jax fwd", 1, quack, 2, kernel=True),
            Case("xla_fwd", "XLA fwd", 1, xla, 2),
            Case("quack_fwd_bwd", "quack_jax fwd+bwd", 3, vjp(quack), kernel=True),
            Case("xla_fwd_bwd", "XLA fwd+bwd", 3, vjp(xla)),
            Case("ce_fwd", "cross_entropy fwd", 1, ce, 2, kernel=True),
            Case("ce_fwd_bwd", "cross_entropy fwd+bwd", 3, vjp(ce), kernel=True),
        ],
        tuned=[
            Tuned("fwd", CE_ENTROPY, 1, quack, lambda x, labels, *_: (x, labels)),
            Tuned("bwd", CE_BWD, 2, *_tuned_backward(True, temperature)),
        ],
        columns=[
            *FWD_COLUMNS,
            *FWD_BWD_COLUMNS,
            ("cross_entropy fwd TB/s", "rate", "ce_fwd"),
            ("cross_entropy fwd+bwd TB/s", "rate", "ce_fwd_bwd"),
            ("fwd vs cross_entropy", "speedup", "ce_fwd", "quack_fwd"),
            ("fwd+bwd vs cross_entropy", "speedup", "ce_fwd_bwd", "quack_fwd_bwd"),
        ],
        footprint=8,
    )


# the gpu tests' row lengths beyond the grid: small logits (rows of 3 classes, of 10, of
# 40), and the vocabulary split over two GPUs (each one's half, and the whole that
# the vocab-parallel tests gather)
SMALL_SIZES = (3, 10, 40)
SHARDED_SIZES = (200, 400, 16000)

SPEC = OpSpec(
    ops=("cross_entropy", "token_logprobs"),
    configs=(CrossEntropyForward, CrossEntropyBackward),
    sizes="vocab",
    lowerings=_lowerings,
    tests={
        "cpu": Shapes(rows=(1, 7), sizes=(2, 1000, 32000), special=(40,)),
        "gpu": Shapes(
            rows=(1, 7, 4096, 16384),
            sizes=(2, 1000, 32000, 50257, 128256, 151936, 262144),
            special=(7, 1024, 65536),
            others=SMALL_SIZES + SHARDED_SIZES,
        ),
    },
    benchmarks=_benchmarks,
)
