"""Compile quack_jax's kernels into a cubin cache, so that GPU runs load them instead of
compiling them. Needs CuTe-DSL (nvidia-cutlass-dsl) but no GPU. Example, every
softmax kernel for two row lengths:

    python -m quack_jax.build --arch sm_90a --cache .cubins --ops softmax log_softmax \\
        --dtypes float32 bfloat16 float16 --sizes 4096 32000

--ops also takes kernel ops (softmax_bwd, as a missing cubin's error names them): each
builds the public ops that launch it.

Every op family declares, in its SPEC (see quack_jax/_registry.py), functions whose
lowering for CUDA launches its kernels; the build lowers them, which compiles exactly the
kernels a GPU run of them would launch, with any number of rows (each function is
lowered twice, as for few rows and as for many: cross-entropy's long rows take streamed
kernels from 2048 rows on, and the norm backward over few row blocks is the variant that
sums its own partials; see docs/decisions/007-row-regimes.md). Norm and cross-entropy
kernels come in variants (norms: weight and bias dtypes, residual, output dtype, the
backward's summing; cross-entropy: label smoothing, softcap); the build covers the usual
ones (no weight, weights in x's dtype or float32; with and without a residual, pre-norm
or not; output in x's dtype; every cross-entropy variant).

--packaged builds the kernels that ship inside the wheel (quack_jax/cubins) for the row
lengths in PACKAGED_SIZES (popular open models' hidden sizes and vocabularies, attention
sequence lengths, QK-norm head sizes, every multiple of 256 up to 8192 for the norms) and
those of `python -m quack_jax.bench --quick`, every op and dtype, in the most used
variants; run it before building the wheel:

    python -m quack_jax.build --packaged && pip wheel --no-deps . -w dist
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import time
from collections.abc import Callable

from . import _cache, _registry
from ._lowering import ROW_REGIMES, lowering, options
from ._spec import OpSpec
from ._tiling import ITEMSIZE
from .norm.rules import QK_NORM_SIZES

ARCHS = ("sm_90a",)
DTYPES = tuple(ITEMSIZE)

# (hidden size, vocabulary) of popular open models, from each one's config.json on the
# Hugging Face Hub (the repository named): the norms' and cross-entropy's row lengths.
COMMON_MODELS = {
    "openai-community/gpt2": (768, 50257),
    "meta-llama/Llama-3.2-1B": (2048, 128256),
    "google/gemma-2-2b": (2304, 256000),
    "meta-llama/Llama-3.2-3B": (3072, 128256),
    "microsoft/Phi-3-mini-4k-instruct": (3072, 32064),
    "Qwen/Qwen2.5-7B": (3584, 152064),
    "meta-llama/Llama-3.1-8B": (4096, 128256),
    "mistralai/Mistral-7B-v0.3": (4096, 32768),
    "Qwen/Qwen2.5-14B": (5120, 152064),
    "deepseek-ai/DeepSeek-V3": (7168, 129280),
    "meta-llama/Llama-3.1-70B": (8192, 128256),
    "meta-llama/Llama-2-7b-hf": (4096, 32000),
    "mistralai/Mistral-7B-v0.1": (4096, 32000),
}
# attention rows (sequence lengths) for softmax
COMMON_SEQUENCES = (1024, 2048, 4096, 8192)

_HIDDEN, _VOCAB = (set(sizes) for sizes in zip(*COMMON_MODELS.values(), strict=True))
# The row lengths of the packaged kernels, by the kind of row an op family normalises
# (``OpSpec.sizes``); ``packaged_sizes`` adds each family's ``bench --quick`` row lengths
# (docs/decisions/019-packaged-kernel-set.md).
PACKAGED_SIZES = {
    # softmax over attention rows
    "sequence": sorted(COMMON_SEQUENCES),
    # the norms: the models' hidden sizes; QK-norm's head sizes (``norm.rules.QK_NORM_SIZES``);
    # and every multiple of 256 up to 8192, the hidden sizes of models not listed (and of
    # small ones being trained)
    "hidden": sorted(_HIDDEN | set(QK_NORM_SIZES) | set(range(256, 8192 + 1, 256))),
    # cross-entropy: the models' vocabularies
    "vocab": sorted(_VOCAB),
}


@contextlib.contextmanager
def _lowering_arch(arch: str):
    previous = os.environ.get("QUACK_JAX_CUDA_ARCH")
    os.environ["QUACK_JAX_CUDA_ARCH"] = arch
    try:
        yield
    finally:
        if previous is None:
            del os.environ["QUACK_JAX_CUDA_ARCH"]
        else:
            os.environ["QUACK_JAX_CUDA_ARCH"] = previous


def lower_for_cuda(
    fn: Callable, args, arch: str = "sm_90a", path: str = "kernel", any_rows: bool = False
) -> str:
    """Lower ``fn`` at ``args`` (shape-dtype structs) for CUDA on any host, which loads or
    compiles every kernel it launches; returns the StableHLO text. ``path``: "kernel" (the
    default) lowers the kernels at every shape, also where the default lowering would
    pick XLA's path, so that builds hold every kernel; "auto" and "reference" as the
    default lowering and XLA's path everywhere. ``any_rows``: the kernels that ``args``
    would take with any number of rows, lowered once as for few rows and once as for many
    (few rows take the tilings held in registers and the norm backward that sums its own
    partials, many rows the streamed tilings and the backward whose partials XLA sums:
    docs/decisions/007-row-regimes.md); the text is the last regime's."""
    import jax

    regimes = ROW_REGIMES if any_rows else [options().regime]
    with _lowering_arch(arch), lowering(path=path):
        for regime in regimes:
            # a fresh function each time: JAX's caches must not return an earlier
            # lowering (one made under another tiling override or regime, say)
            with lowering(regime=regime):
                lowered = (
                    jax.jit(lambda *a: fn(*a)).trace(*args).lower(lowering_platforms=("cuda",))
                )
        return lowered.as_text()


def build(ops, dtypes, sizes, arch: str, verbose: bool = True, packaged: bool = False) -> None:
    """Build the kernels of ``ops`` by lowering the functions their family's SPEC
    declares, for CUDA; ``packaged``: only the variants that ship in the wheel."""
    specs = _registry.specs()
    start = time.perf_counter()
    with _cache.kernels_used() as kernels:
        for op in ops:
            for dtype in dtypes:
                for n in sizes:
                    for fn, args in specs[op].lowerings(op, dtype, n, packaged):
                        lower_for_cuda(fn, args, arch, any_rows=True)
                    if verbose:
                        print(f"{op:13s} {dtype:9s} n={n:<7d} ready", flush=True)
    if verbose:
        print(
            f"{' '.join(ops)}: {len(kernels)} kernels ready in {time.perf_counter() - start:.1f} s"
        )


def packaged_sizes(spec: OpSpec) -> list[int]:
    """The row lengths of an op family's packaged kernels: ``PACKAGED_SIZES`` of its kind
    and the row lengths of its benchmarks' quick shapes (``python -m quack_jax.bench
    --quick`` then runs on the wheel alone)."""
    quick = {n for b in (spec.benchmarks() if spec.benchmarks else ()) for _, n in b.quick_shapes}
    return sorted(set(PACKAGED_SIZES[spec.sizes]) | quick)


def build_packaged(arch: str, verbose: bool = True) -> None:
    """The kernels that ship in the wheel: every op and dtype, at ``packaged_sizes``, into
    the cache folder. Its entries of other kernel sources (the kernels or the tiling
    changed since), which no lookup finds, are removed first, so that the wheel does not
    carry them (docs/decisions/003-cubin-cache-key.md)."""
    for entry in _cache.stale_entries(_cache.cache_dir()):
        entry.unlink()
    for op, spec in _registry.specs().items():
        build([op], DTYPES, packaged_sizes(spec), arch, verbose, packaged=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m quack_jax.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--arch", default="sm_90a", choices=ARCHS, help="the GPU architecture; default: sm_90a"
    )
    parser.add_argument(
        "--cache",
        help="cache folder; default: $QUACK_JAX_CACHE, else $XDG_CACHE_HOME/quack_jax, "
        "else ~/.cache/quack_jax",
    )
    public, kernel_ops = list(_registry.specs()), list(_registry.kernel_configs())
    parser.add_argument(
        "--ops",
        nargs="+",
        default=public,
        choices=public + kernel_ops,
        help="public ops, or kernel ops (the public ops that launch them); default: all",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=list(DTYPES),
        choices=DTYPES,
        help="input dtypes; default: all",
    )
    parser.add_argument("--sizes", nargs="+", type=int, help="row lengths n")
    parser.add_argument(
        "--packaged",
        action="store_true",
        help="the kernels shipped in the wheel (quack_jax/cubins), for PACKAGED_SIZES",
    )
    args = parser.parse_args(argv)
    if importlib.util.find_spec("cutlass") is None:
        parser.exit(
            1,
            f"{parser.prog} compiles kernels with CuTe-DSL, which is not installed: "
            f"{_cache.INSTALL_COMPILER}\n",
        )
    if args.packaged:
        from ._cache import PACKAGED

        os.environ["QUACK_JAX_CACHE"] = str(PACKAGED)
        build_packaged(args.arch)
        return
    if not args.sizes:
        parser.error("--sizes is required (or --packaged)")
    if args.cache:
        os.environ["QUACK_JAX_CACHE"] = args.cache
    ops = [o for op in args.ops for o in (_registry.public_ops(op) if op in kernel_ops else [op])]
    build(list(dict.fromkeys(ops)), args.dtypes, args.sizes, args.arch)


if __name__ == "__main__":
    main()
