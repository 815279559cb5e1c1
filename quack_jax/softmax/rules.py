"""Where softmax's default lowering takes XLA's formulation instead of the kernels: small
and decode shapes, whose time is mostly the launch. Each primitive's rule is a predicate
of (rows, row length, itemsize, **its params)."""

from __future__ import annotations

# Where XLA's formulation measured faster (small and decode shapes): the forward up to
# SOFTMAX_BYTES of input (docs/decisions/004-small-shape-xla-rules.md), and softmax's
# derivative over rows of at most SOFTMAX_DERIVATIVE_N elements, where its forward is on
# XLA too (docs/decisions/005-softmax-derivative-on-xla.md).
SOFTMAX_BYTES, SOFTMAX_DERIVATIVE_N = 8 << 20, 2048


def forward_on_xla(m: int, n: int, itemsize: int, **_) -> bool:
    return m * n * itemsize <= SOFTMAX_BYTES


def derivative_on_xla(m: int, n: int, itemsize: int, *, kind, **_) -> bool:
    return kind == "softmax" and n <= SOFTMAX_DERIVATIVE_N and m * n * itemsize <= SOFTMAX_BYTES
