"""The softmax kernels' launch shapes (``_tiling.TilingFamily``). Each table row is the
tuner's fastest candidate at the benchmark size that ends its range:
docs/decisions/008-tiling-tables.md."""

from .._tiling import K, TilingFamily

SOFTMAX_FWD = TilingFamily(
    "softmax_fwd",
    {
        2: [
            (1 * K, (16, 128, 1)),
            (4 * K, (32, 128, 1)),
            (16 * K, (256, 256, 1)),
            (64 * K, (256, 256, 4)),
            (128 * K, (128, 128, 16)),
            (256 * K, (256, 256, 16)),
        ],
        4: [
            (1 * K, (16, 256, 1)),
            (4 * K, (32, 128, 1)),
            (16 * K, (64, 128, 4)),
            (64 * K, (64, 128, 8)),
            (256 * K, (128, 128, 16)),
        ],
    },
)
# the derivative keeps x and the tangent: two live values an element
SOFTMAX_BWD = TilingFamily(
    "softmax_bwd",
    {
        2: [
            (1 * K, (32, 256, 1)),
            (4 * K, (64, 128, 1)),
            (16 * K, (64, 128, 8)),
            (128 * K, (128, 128, 16)),
            (256 * K, (512, 512, 8)),
        ],
        4: [
            (1 * K, (32, 128, 1)),
            (4 * K, (64, 128, 1)),
            (16 * K, (64, 128, 8)),
            (128 * K, (128, 128, 16)),
            (256 * K, (256, 256, 16)),
        ],
    },
    live=2,
)
