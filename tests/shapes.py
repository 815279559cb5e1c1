"""Sizes the GPU tests use; ``benchmarks/prebuild.py`` compiles kernels for all of them."""

GPU_ROWS = (1, 3, 1000, 32768)
GPU_SIZES = (1, 7, 100, 1024, 4096, 5000, 16384, 65536, 131071, 262144)
# Sizes of the special-value cases: one row per warp, several warps, a cluster.
SPECIAL_SIZES = (7, 1024, 65536)
GPU_DTYPES = ("float32", "bfloat16", "float16")
# Largest test tensor, in elements: bounds the float64 reference's memory.
MAX_ELEMENTS = 2**28
# RMSNorm / LayerNorm
NORM_ROWS = (1, 3, 1000, 16384)
NORM_SIZES = (1, 7, 128, 1000, 4096, 5120, 8192, 16384, 65536)
# Sizes at which every operand mix is tested (elsewhere one mix per shape, in turn).
NORM_VARIANT_SIZES = (7, 1000, 4096, 65536)
# Cross-entropy
CE_ROWS = (1, 7, 4096, 16384)
CE_VOCABS = (2, 1000, 32000, 50257, 128256, 151936, 262144)
CE_DTYPES = ("float32", "bfloat16")
