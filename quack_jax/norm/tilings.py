"""The norm kernels' launch shapes (``_tiling.TilingFamily``), with float32 weights (and
bias), tuned on the driver's persistent grids: RMSNorm and LayerNorm each have their own,
since LayerNorm's two reductions and bias move its best tilings
(docs/decisions/014-norm-tilings-and-direct-forward.md).

Persistent kernels launch one wave of clusters, except for rows up to ``full_grid_up_to``,
where one CTA per row block measured faster: the float32 forwards up to n = 8192, which on
that grid load their rows straight into registers (``kernels/norm.py``'s ``staged``), and
whose table entries up to 8192 are tuned for that kernel. At 16384 and in bfloat16 one
staged wave was as fast or faster.
"""

from .._tiling import K, TilingFamily

RMS_NORM_FWD = TilingFamily(
    "rms_norm_fwd",
    {
        2: [
            (1 * K, (32, 256, 1)),
            (4 * K, (64, 128, 2)),
            (8 * K, (128, 128, 2)),
            (16 * K, (64, 128, 4)),
            (64 * K, (64, 256, 16)),
        ],
        4: [
            (1 * K, (32, 256, 1)),
            (2 * K, (32, 256, 1)),
            (4 * K, (128, 256, 1)),
            (8 * K, (128, 128, 2)),
            (16 * K, (32, 256, 8)),
            (64 * K, (128, 128, 8)),
        ],
    },
    full_grid_up_to={4: 8 * K},
)
RMS_NORM_BWD = TilingFamily(
    "rms_norm_bwd",
    {
        2: [
            (1 * K, (32, 128, 1)),
            (4 * K, (256, 512, 1)),
            (8 * K, (512, 512, 1)),
            (16 * K, (128, 128, 8)),
            (64 * K, (128, 128, 16)),
        ],
        4: [
            (1 * K, (32, 256, 1)),
            (4 * K, (128, 512, 2)),
            (8 * K, (256, 256, 1)),
            (16 * K, (512, 512, 2)),
            (64 * K, (128, 128, 16)),
        ],
    },
)
LAYER_NORM_FWD = TilingFamily(
    "layer_norm_fwd",
    {
        2: [
            (1 * K, (32, 128, 1)),
            (4 * K, (64, 512, 2)),
            (8 * K, (64, 256, 4)),
            (16 * K, (128, 256, 4)),
            (64 * K, (256, 256, 8)),
        ],
        4: [
            (1 * K, (32, 128, 1)),
            (2 * K, (64, 256, 1)),
            (4 * K, (128, 256, 1)),
            (8 * K, (256, 256, 1)),
            (16 * K, (64, 512, 8)),
            (64 * K, (256, 256, 8)),
        ],
    },
    full_grid_up_to={4: 8 * K},
)
LAYER_NORM_BWD = TilingFamily(
    "layer_norm_bwd",
    {
        2: [
            (1 * K, (64, 128, 1)),
            (4 * K, (256, 256, 1)),
            (8 * K, (128, 128, 4)),
            (16 * K, (128, 256, 8)),
            (64 * K, (256, 256, 16)),
        ],
        4: [
            (1 * K, (64, 512, 1)),
            (4 * K, (256, 512, 1)),
            (8 * K, (256, 256, 2)),
            (16 * K, (256, 256, 4)),
            (64 * K, (512, 512, 8)),
        ],
    },
)


def forward_family(rms: bool) -> TilingFamily:
    return RMS_NORM_FWD if rms else LAYER_NORM_FWD


def backward_family(rms: bool) -> TilingFamily:
    return RMS_NORM_BWD if rms else LAYER_NORM_BWD
