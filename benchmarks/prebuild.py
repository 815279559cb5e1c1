"""Compile every kernel that the GPU tests and the benchmarks need; no GPU needed.

    python benchmarks/prebuild.py --cache .cubins          # tests and benchmarks
    python benchmarks/prebuild.py --cache .cubins --tune   # and the tuner's candidates

Carry the cache folder to the GPU machine and point QUACK_JAX_CACHE at it.
"""

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import run  # noqa: E402
import shapes  # noqa: E402

from quack_jax.build import build, configs  # noqa: E402


def specs(tune: bool = False):
    sizes = sorted(set(shapes.GPU_SIZES) | set(shapes.SPECIAL_SIZES))
    out = configs(["softmax", "log_softmax"], shapes.GPU_DTYPES, sizes)
    out += configs(["softmax"], run.DTYPES, [n for _, n in run.SHAPES], candidates=tune)
    return list(dict.fromkeys(out))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", required=True)
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args()
    os.environ["QUACK_JAX_CACHE"] = args.cache
    build(specs(args.tune), "sm_90a")


if __name__ == "__main__":
    main()
