"""What softmax declares for the tools: the functions whose lowering builds its kernels,
its benchmark and its test grid."""

from __future__ import annotations

import jax

from .._spec import (
    FWD_BWD_COLUMNS,
    FWD_COLUMNS,
    TILINGS,
    Benchmark,
    Case,
    OpSpec,
    Shapes,
    Tuned,
    fwd_bwd,
)
from .api import log_softmax, softmax
from .config import Softmax, SoftmaxDerivative
from .derivative import derivative
from .tilings import SOFTMAX_BWD, SOFTMAX_FWD


def _lowerings(op: str, dtype: str, n: int, packaged: bool):
    """The forward and ``jax.vjp`` (forward and backward kernels); for log-softmax also
    ``jax.jvp`` (its forward-mode kernel)."""
    f = softmax if op == "softmax" else log_softmax
    x = jax.ShapeDtypeStruct((8, n), dtype)

    def vjp(x):
        y, pullback = jax.vjp(f, x)
        return y, pullback(x)

    yield vjp, (x,)
    if op == "log_softmax":
        yield (lambda x: jax.jvp(f, (x,), (x,))), (x,)


def _benchmarks():
    """softmax against ``jax.nn.softmax``: forward, and ``jax.vjp`` that also returns y."""
    shapes = [(32768, 1024), (16384, 4096), (8192, 16384), (4096, 65536), (2048, 131072)]
    shapes += [(1024, 262144)]

    def backward(dy, y):
        return derivative.bind(dy, y, kind="softmax")[0]

    return [
        Benchmark(
            "softmax",
            shapes,
            quick_shapes=[(4096, 1024), (512, 8192)],
            arguments=lambda m, n, dtype: [((m, n), dtype)] * 2,
            cases=[
                Case("quack_fwd", "quack_jax fwd", 2, softmax, -1, kernel=True),
                Case("xla_fwd", "XLA fwd", 2, jax.nn.softmax, -1),
                Case("quack_fwd_bwd", "quack_jax fwd+bwd", 5, fwd_bwd(softmax), kernel=True),
                Case("xla_fwd_bwd", "XLA fwd+bwd", 5, fwd_bwd(jax.nn.softmax)),
            ],
            tuned=[
                Tuned("fwd", SOFTMAX_FWD, 2, softmax, lambda x, dy: (x,)),
                Tuned("bwd", SOFTMAX_BWD, 3, backward, lambda x, dy: (dy, softmax(x))),
            ],
            columns=[
                *FWD_COLUMNS,
                ("fwd / copy", "fraction", "quack_fwd", "copy"),
                *FWD_BWD_COLUMNS,
                TILINGS,
            ],
            footprint=6,
            latency_shapes=Benchmark.latency((1024, 4096, 8192)),  # attention rows
        )
    ]


SPEC = OpSpec(
    ops=("softmax", "log_softmax"),
    configs=(Softmax, SoftmaxDerivative),
    sizes="sequence",
    lowerings=_lowerings,
    tests={
        "cpu": Shapes(rows=(1, 3), sizes=(1, 7, 1000, 5000, 131071), special=(40,)),
        "gpu": Shapes(
            rows=(1, 3, 1000, 32768),
            sizes=(1, 7, 100, 1024, 4096, 5000, 16384, 65536, 131071, 262144),
            special=(7, 1024, 65536),  # one row per warp, several warps, a cluster
            others=(1000,),  # the rows of the other families' single tests
        ),
    },
    benchmarks=_benchmarks,
)
