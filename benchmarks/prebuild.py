"""Compile every kernel that the GPU tests and the benchmarks need; no GPU needed.

    python benchmarks/prebuild.py --cache .cubins          # tests and benchmarks
    python benchmarks/prebuild.py --cache .cubins --tune   # and the tuner's candidates

    python benchmarks/prebuild.py --cache .cubins --tune cross_entropy  # one op's only
    python benchmarks/prebuild.py --cache .cubins --only cross_entropy linear_ce

Every kernel is built by lowering, for an sm_90a CUDA device on this machine, the
functions that launch it: the benchmark's quack_jax functions (and, with ``--tune``, each
tuned kernel under each candidate tiling, on both grids where the tuner times both);
for the GPU tests, each op family's ``SPEC.test_lowerings("gpu")`` (the test suite's
toy family ``tests/l2_norm`` included), the one list of what its tests launch; and the
cases that the scripts ``sharded.py``, ``train_lm.py`` and ``linear_ce.py`` list in
``prebuild_cases()``.
Lowering takes each kernel from the cache and compiles the missing ones, so exactly the
kernels (variants, tilings) those functions launch get built, at any number of rows
(each function is lowered once with few rows and once with many; see
``quack_jax.build.lower_for_cuda``'s ``any_rows``).

Carry the cache folder to the GPU machine and point QUACK_JAX_CACHE at it.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import jax  # noqa: E402

from quack_jax import (  # noqa: E402
    _cache,
    _ffi,
    _registry,
    bench,
)
from quack_jax._lowering import lowering  # noqa: E402
from quack_jax._spec import OpSpec  # noqa: E402
from quack_jax._tiling import ITEMSIZE, RowTiling, TilingFamily  # noqa: E402
from quack_jax.build import lower_for_cuda as lower_fn  # noqa: E402

ARCH = "sm_90a"
BENCH_OPS = tuple(bench.benchmarks())
# the test suite's toy op family (tests/l2_norm), which test_registry registers
TEST_FAMILIES = ("l2_norm",)
# scripts whose prebuild_cases() list functions that their GPU runs launch kernels from
SCRIPTS = ("sharded", "train_lm", "linear_ce")


class Lowering(NamedTuple):
    label: str
    fn: Callable
    args: tuple  # jax.ShapeDtypeStruct
    tiling: tuple[TilingFamily, int, int, RowTiling] | None = None  # (family, n, itemsize, tiling)
    needs_kernel: bool = True  # lowering without a kernel launch is an error
    one_wave: bool | None = None  # the grid (None: each family's rule; see _lowering)


def _benchmark_shapes(ops=BENCH_OPS, tuned: bool = False):
    """(op, dtype, n, the op's arguments) for the benchmark shapes of ``ops``: one per
    row length of its table's, ``--quick``'s and ``--latency``'s shapes (each lowering
    holds the kernels of any number of rows); with ``tuned``, every shape that ``bench
    --tune`` (and ``--quick --tune``) times, where the launched tiling may depend on m."""
    for name in ops:
        op = bench.benchmarks()[name]
        for dtype in bench.DTYPES:
            shapes = op.shapes + op.quick_shapes
            if not tuned:
                per_n = {n: m for m, n in shapes + op.latency_shapes}
                shapes = [(m, n) for n, m in per_n.items()]
            for m, n in shapes:
                args = tuple(jax.ShapeDtypeStruct(s, d) for s, d, *_ in op.arguments(m, n, dtype))
                yield op, dtype, n, args


def benchmark_lowerings(ops=BENCH_OPS) -> list[Lowering]:
    """The benchmark's quack_jax functions of ``ops`` at every dtype and row length it
    runs."""
    return [
        Lowering(f"{op.name} {case.key} {dtype} n={n}", case.fn, args[: case.args])
        for op, dtype, n, args in _benchmark_shapes(ops)
        for case in op.cases
        if case.kernel
    ]


def tuning_lowerings(ops=BENCH_OPS) -> list[Lowering]:
    """Each kernel of ``ops`` that the tuner times, under each of its candidate tilings, at
    every shape that ``bench --tune`` (and ``--quick --tune``) runs. The candidates start
    from the tiling the shape launches (``bench.launched_tiling``, as the tuner does), so
    the benchmark's kernels must be in the cache or buildable."""
    out = {}
    for op, dtype, n, args in _benchmark_shapes(ops, tuned=True):
        e = ITEMSIZE[dtype]
        for t in op.tuned:
            operands = tuple(jax.eval_shape(t.prepare, *args))
            for tag, tiling, one_wave in t.runs(n, e, bench.launched_tiling(t, args)):
                label = f"{op.name} {t.name} {dtype} n={n} {tag}"
                override = (t.family, n, e, tiling)
                low = Lowering(label, t.fn, operands, override, one_wave=one_wave)
                out.setdefault((label, tiling), low)
    return list(out.values())


def test_families() -> dict[str, OpSpec]:
    """Each op family's spec, the test suite's toy families included, by its first op."""
    toys = [importlib.import_module(family).SPEC for family in TEST_FAMILIES]
    return {spec.ops[0]: spec for spec in [*_registry.families(), *toys]}


def test_lowerings(families=None) -> list[Lowering]:
    """What the GPU tests launch: each family's ``SPEC.test_lowerings("gpu")`` (row
    lengths past the kernels' reach launch none)."""
    found = test_families()
    return [
        Lowering(f"{op} {dtype} n={n}", fn, args, needs_kernel=False)
        for name in families or found
        for op, dtype, n, fn, args in found[name].test_lowerings("gpu")
    ]


def script_lowerings(scripts=SCRIPTS) -> list[Lowering]:
    """``prebuild_cases()`` of the scripts."""
    out = []
    for name in scripts:
        module = importlib.import_module(name)
        for i, (fn, args) in enumerate(module.prebuild_cases()):
            x = jax.tree.leaves(args)[0]
            label = f"{name} case {i}: {x.dtype} {'x'.join(map(str, x.shape))}"
            out.append(Lowering(label, fn, tuple(args), needs_kernel=False))
    return out


def lower_for_cuda(lowerings, what: str, arch: str = ARCH, verbose: bool = True):
    """Lower each function for a CUDA device of ``arch`` (none needs to be present), which
    puts every kernel it launches in the cache, compiling the missing ones. Returns the
    kernels the lowerings launch, as (op, dtype, tiling, variant), in the order first met."""
    start = time.perf_counter()
    kernels = {}
    for i, low in enumerate(lowerings):
        t0 = time.perf_counter()
        with _cache.kernels_used() as used:
            launches = _lower(low, arch)
        if low.tiling and low.tiling[3] not in [tiling for _, _, tiling, _ in used]:
            raise RuntimeError(f"{low.label}: the tiling override did not reach the kernel")
        new = [k for k in used if k not in kernels]
        kernels.update(dict.fromkeys(used))
        if verbose and new:
            print(
                f"[{i + 1}/{len(lowerings)}] {low.label:40s} {launches} launches "
                f"{time.perf_counter() - t0:5.2f} s",
                flush=True,
            )
            for op, dtype, tiling, variant in new:
                tag = f"{op}{_cache.variant_tag(variant)}"
                print(f"    {tag:56s} {dtype:9s} n={tiling.n:<7d} {tiling.tag}", flush=True)
    if verbose:
        print(f"{what}: {len(kernels)} kernels ready in {time.perf_counter() - start:.1f} s")
    return list(kernels)


def _lower(low: Lowering, arch: str) -> int:
    """Lower one function for CUDA; returns how many kernel launches it holds."""
    tilings = {low.tiling[:3]: low.tiling[3]} if low.tiling else {}
    with lowering(tilings=tilings, one_wave=low.one_wave):
        text = lower_fn(low.fn, low.args, arch, any_rows=True)
    launches = text.count(f"custom_call @{_ffi.TARGET}")
    if low.needs_kernel and not launches:
        raise RuntimeError(f"{low.label}: lowered for {arch} without a kernel launch")
    return launches


def build_lowered(tune=(), verbose: bool = True):
    """Every kernel that the benchmark (and its tuner, for the ops in ``tune``), the GPU
    tests and the scripts launch, built by lowering them for sm_90a. Returns the kernels
    (see ``lower_for_cuda``)."""
    kernels = lower_for_cuda(benchmark_lowerings(), "benchmark", ARCH, verbose)
    if tune:
        kernels += lower_for_cuda(tuning_lowerings(tune), "tuner candidates", ARCH, verbose)
    kernels += lower_for_cuda(test_lowerings(), "GPU tests", ARCH, verbose)
    kernels += lower_for_cuda(script_lowerings(), "scripts", ARCH, verbose)
    return list(dict.fromkeys(kernels))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", required=True)
    parser.add_argument(
        "--tune", nargs="*", metavar="OP", help="also the tuner's candidates (of these ops; all)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="FAMILY_OR_SCRIPT",
        help=f"only these families' GPU tests (by first op: {', '.join(test_families())}) "
        f"or these scripts' cases ({', '.join(SCRIPTS)})",
    )
    args = parser.parse_args()
    os.environ["QUACK_JAX_CACHE"] = args.cache
    if args.only:
        unknown = set(args.only) - set(test_families()) - set(SCRIPTS)
        if unknown:
            parser.error(f"--only: unknown {', '.join(sorted(unknown))}")
        families = [name for name in args.only if name not in SCRIPTS]
        scripts = [name for name in args.only if name in SCRIPTS]
        lowerings = (test_lowerings(families) if families else []) + script_lowerings(scripts)
        lower_for_cuda(lowerings, "the kernels of " + ", ".join(args.only))
        return
    tune = [] if args.tune is None else args.tune or list(BENCH_OPS)
    kernels = build_lowered(tune)
    counts = collections.Counter(op for op, *_ in kernels)
    print(f"{len(kernels)} lowered kernels: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
