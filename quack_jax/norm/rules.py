"""Where the norms' default lowering takes XLA's formulation instead of the kernels:
small and decode shapes, whose time is mostly the launch. Each primitive's rule is a
predicate of (rows, row length, itemsize, **its params)."""

from __future__ import annotations

# QK-norm: an RMSNorm over each attention head of the queries and keys (Qwen3, Gemma 3,
# OLMo 2), rows of the head sizes
QK_NORM_SIZES = (64, 128, 256)
# The forward outside autodiff up to NORM_BYTES of input, and RMSNorm's over rows of at
# most QK_NORM elements at any row count (docs/decisions/004-small-shape-xla-rules.md).
# Under autodiff the forward keeps its kernel: XLA's forward before the backward kernel
# made fwd+bwd slower than the two kernels.
NORM_BYTES, QK_NORM = 32 << 20, max(QK_NORM_SIZES)
# The forward under autodiff and the backward on XLA together, where XLA fuses the pair
# as it fuses its own autodiff (docs/decisions/006-norm-pair-on-xla.md): by RMSNorm
# (rms) or LayerNorm, the fewest rows, the shortest rows, the most bytes of input.
NORM_PAIR = {True: (8, 4096, 1 << 20), False: (64, 1, 2 << 20)}


def norm_pair_on_xla(m: int, n: int, itemsize: int, rms: bool) -> bool:
    """Whether a norm's forward under autodiff and its backward both lower to XLA."""
    fewest, shortest, most = NORM_PAIR[rms]
    return m >= fewest and n >= shortest and m * n * itemsize <= most


def forward_on_xla(m: int, n: int, itemsize: int, *, rms, differentiated, **_) -> bool:
    if differentiated:
        return norm_pair_on_xla(m, n, itemsize, rms)
    return m * n * itemsize <= NORM_BYTES or (rms and n <= QK_NORM)


def backward_on_xla(m: int, n: int, itemsize: int, *, rms, **_) -> bool:
    return norm_pair_on_xla(m, n, itemsize, rms)
