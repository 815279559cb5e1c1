"""The cross-entropy kernels' launch shapes (``_tiling.TilingFamily``).

The forward reduces a row like softmax's forward (reads only), and takes its tables. The
backward is elementwise, so long rows are split into column blocks of separate CTAs
(``cluster_n`` of them, launched without a cluster) of about 32 elements a thread.

Streamed tilings: at ``_tiling.STREAM_MIN_ROWS`` rows or more, a thread that holds one
group of its row at a time lets several CTAs share an SM. Fewer rows, and rows whose
vectors are under 8 bytes (n = 50257, say, which streams slower than it runs held in
registers), take the tables. A kernel with more live values per element than its
family's (the forward with label smoothing) takes proportionally fewer elements per step.
Tuned at 2048 to 8192 rows: docs/decisions/009-streamed-cross-entropy-tilings.md.
"""

from .._tiling import K, TilingFamily
from ..softmax.tilings import SOFTMAX_FWD

CE_FWD = TilingFamily(
    "ce_fwd",
    SOFTMAX_FWD.tables,
    streamed={2: [(16 * K, None), (128 * K, (128, 128, 1, 32)), (256 * K, (256, 256, 1, 32))]},
)
# the forward with the entropy (token_logprobs): two live values an element
CE_ENTROPY = TilingFamily(
    "ce_entropy",
    SOFTMAX_FWD.tables,
    live=2,
    streamed={2: [(16 * K, None), (256 * K, (128, 128, 1, 16))]},
)
_BWD_TABLE = [
    (1 * K, (32, 256, 1)),
    (2 * K, (64, 256, 1)),
    (4 * K, (128, 256, 1)),
    (8 * K, (256, 256, 1)),
    (16 * K, (256, 256, 2)),
    (32 * K, (256, 256, 4)),
    (64 * K, (256, 256, 8)),
    (256 * K, (256, 256, 16)),
]
CE_BWD = TilingFamily(
    "ce_bwd",
    {2: _BWD_TABLE, 4: _BWD_TABLE},
    live=2,
    streamed={
        2: [
            (16 * K, None),
            (64 * K, (512, 512, 1, 32)),
            (160 * K, (1024, 1024, 1, 32)),
            (256 * K, (512, 512, 1, 32)),
        ]
    },
)
# The forward that also writes the gradient (a mean or sum loss under autodiff) reads and
# writes the row, so it has a table of its own, tuned alone at n = 1024, 32000, 50257,
# 128256, 151936 and 262144, the softmax forward's entries between them:
# docs/decisions/011-cross-entropy-forward-writes-gradient.md. At n = 151936 and 152064
# bfloat16 takes 256-thread CTAs in clusters of 8 and float16 1024-thread CTAs in
# clusters of 4: docs/decisions/029-cross-entropy-gradient-tiling-by-dtype.md.
_GRAD_16 = [
    (1 * K, (32, 256, 1)),
    (4 * K, (32, 128, 1)),
    (16 * K, (256, 256, 1)),
    (32 * K, (256, 256, 4)),
    (128 * K, (128, 128, 8)),
    (160 * K, (1024, 1024, 4)),
    (256 * K, (128, 128, 16)),
]
CE_GRAD = TilingFamily(
    "ce_grad",
    {
        2: _GRAD_16,
        4: [
            (1 * K, (32, 128, 1)),
            (4 * K, (32, 128, 1)),
            (16 * K, (64, 128, 4)),
            (32 * K, (128, 128, 4)),
            (64 * K, (128, 128, 8)),
            (256 * K, (128, 128, 16)),
        ],
    },
    dtype_tables={
        "bfloat16": [
            entry if entry[0] != 160 * K else (160 * K, (256, 256, 8)) for entry in _GRAD_16
        ]
    },
)


def forward_family(*, grad: bool, entropy: bool) -> TilingFamily:
    """The forward's family: with the gradient, with the entropy, or the loss alone."""
    return CE_GRAD if grad else CE_ENTROPY if entropy else CE_FWD
