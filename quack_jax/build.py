"""Precompile kernels into a cubin cache: ``python -m quack_jax.build --help``.

Needs nvidia-cutlass-dsl but no GPU. Example, every softmax kernel for two row lengths::

    python -m quack_jax.build --arch sm_90a --cache .cubins --ops softmax log_softmax \\
        --dtypes float32 bfloat16 float16 --sizes 4096 32000
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterable

from ._tiling import ITEMSIZE, RowTiling, candidate_tilings, choose_tiling

# public op -> its kernel ops and their tiling families
OPS = {
    "softmax": (("softmax_fwd", "softmax_fwd"), ("softmax_bwd", "softmax_bwd")),
    "log_softmax": (
        ("log_softmax_fwd", "softmax_fwd"),
        ("log_softmax_bwd", "softmax_bwd"),
        ("log_softmax_jvp", "softmax_bwd"),
    ),
}
ARCHS = ("sm_90a",)
DTYPES = tuple(ITEMSIZE)


def configs(
    ops: Iterable[str], dtypes: Iterable[str], sizes: Iterable[int], candidates: bool = False
) -> list[tuple[str, str, RowTiling]]:
    """(kernel op, dtype, tiling) for every kernel the public ops need at these sizes; with
    ``candidates``, also the alternative tilings that the benchmark's tuner tries."""
    out = []
    for op in ops:
        for kernel_op, family in OPS[op]:
            for dtype in dtypes:
                for n in sizes:
                    tilings = [choose_tiling(family, n, ITEMSIZE[dtype])]
                    if candidates:
                        tilings += candidate_tilings(family, n, ITEMSIZE[dtype])
                    out += [(kernel_op, dtype, t) for t in dict.fromkeys(tilings) if t]
    return out


def build(specs: list[tuple[str, str, RowTiling]], arch: str, verbose: bool = True) -> None:
    from ._cache import get_kernel

    start = time.perf_counter()
    for i, (op, dtype, tiling) in enumerate(specs):
        t0 = time.perf_counter()
        kernel = get_kernel(op, dtype, tiling, arch)
        if verbose:
            print(
                f"[{i + 1}/{len(specs)}] {op:16s} {dtype:9s} n={tiling.n:<7d} {tiling.tag:16s} "
                f"{len(kernel.cubin):7d} B  {time.perf_counter() - t0:5.2f} s",
                flush=True,
            )
    if verbose:
        print(f"{len(specs)} kernels ready in {time.perf_counter() - start:.1f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m quack_jax.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--arch", default="sm_90a", choices=ARCHS)
    parser.add_argument("--cache", help="cache folder (default: $QUACK_JAX_CACHE or ~/.cache)")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--sizes", nargs="+", type=int, required=True, help="row lengths n")
    parser.add_argument(
        "--candidates",
        action="store_true",
        help="also the alternative tilings the benchmark tuner tries",
    )
    args = parser.parse_args(argv)
    if args.cache:
        os.environ["QUACK_JAX_CACHE"] = args.cache
    build(configs(args.ops, args.dtypes, args.sizes, args.candidates), args.arch)


if __name__ == "__main__":
    main()
