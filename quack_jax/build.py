"""Precompile kernels into a cubin cache: ``python -m quack_jax.build --help``.

Needs nvidia-cutlass-dsl but no GPU. Example, every softmax kernel for two row lengths::

    python -m quack_jax.build --arch sm_90a --cache .cubins --ops softmax log_softmax \\
        --dtypes float32 bfloat16 float16 --sizes 4096 32000

Norm and cross-entropy kernels come in variants (norms: weight and bias dtypes,
residual, output dtype; cross-entropy: label smoothing, softcap); the build covers the
usual ones (no weight, weights in x's dtype or float32; with and without a residual,
pre-norm or not; output in x's dtype; every cross-entropy variant) by lowering each op's
forward and backward for CUDA, which compiles exactly the kernels a GPU run of them would
launch.

``--packaged`` builds the kernels that ship inside the wheel (``quack_jax/cubins``) for
the row lengths of popular open models (``COMMON_MODELS``), every op and dtype, in the
most used variants; run it before building the wheel::

    python -m quack_jax.build --packaged && pip wheel --no-deps . -w dist
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator

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
# public ops whose kernels are built by lowering them (see lowered_functions)
LOWERED_OPS = ("rms_norm", "layer_norm", "cross_entropy")
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
}
# attention rows (sequence lengths) for softmax
COMMON_SEQUENCES = (1024, 2048, 4096, 8192)


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


def lower_for_cuda(fn: Callable, args, arch: str = "sm_90a") -> str:
    """Lower ``fn`` at ``args`` (shape-dtype structs) for CUDA on any host, which loads or
    compiles every kernel it launches; returns the StableHLO text."""
    import jax

    with _lowering_arch(arch):
        # a fresh function each time: JAX's caches must not return an earlier lowering
        # (one made under another tiling override, say)
        fresh = jax.jit(lambda *a: fn(*a))
        return fresh.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


NORM_MIXES = ((False, False), (True, False), (True, True))  # (residual, prenorm)


def norm_functions(
    op: str, dtype: str, n: int, packaged: bool = False
) -> Iterator[tuple[Callable, tuple]]:
    """(fn, args): forward and backward (``jax.vjp``) of ``op`` for the usual operand
    mixes; ``packaged``: weights in x's dtype or float32, no residual or a pre-norm one."""
    import jax

    from . import norm

    apply = getattr(norm, op)
    row = jax.ShapeDtypeStruct((8, n), dtype)
    param_dtypes = (dtype, "float32") if packaged else (None, dtype, "float32")
    for param_dtype in param_dtypes:
        vec = jax.ShapeDtypeStruct((n,), param_dtype) if param_dtype else None
        params = (vec,) * (1 if op == "rms_norm" else 2) if vec else ()
        for residual, prenorm in NORM_MIXES[::2] if packaged else NORM_MIXES:

            def fn(x, params, res, dy, prenorm=prenorm):
                def f(x, params, res):
                    return apply(x, *params, residual=res, prenorm=prenorm)

                out, vjp = jax.vjp(f, x, params, res)
                return out, vjp((dy, x) if prenorm else dy)

            yield fn, (row, params, row if residual else None, row)


def cross_entropy_functions(
    dtype: str, n: int, packaged: bool = False
) -> Iterator[tuple[Callable, tuple]]:
    """(fn, args): with each kernel variant (label smoothing or not, softcap or not;
    ``packaged``: neither), the gradient of the mean loss (one forward kernel that writes
    the gradient), and the per-row losses and lse under ``jax.vjp`` (forward and backward
    kernels)."""
    import jax

    from .cross_entropy import cross_entropy

    args = (jax.ShapeDtypeStruct((8, n), dtype), jax.ShapeDtypeStruct((8,), "int32"))
    for smoothing in (0.0,) if packaged else (0.0, 0.1):
        for softcap in (None,) if packaged else (None, 30.0):
            options = dict(label_smoothing=smoothing, logit_softcap=softcap)

            def mean(x, labels, options=options):
                return jax.value_and_grad(lambda x: cross_entropy(x, labels, **options))(x)

            def rows(x, labels, options=options):
                def f(x):
                    return cross_entropy(x, labels, reduction="none", return_lse=True, **options)

                out, vjp = jax.vjp(f, x)
                return out, vjp(out)

            yield mean, args
            yield rows, args


def lowered_functions(
    op: str, dtype: str, n: int, packaged: bool = False
) -> Iterator[tuple[Callable, tuple]]:
    if op == "cross_entropy":
        return cross_entropy_functions(dtype, n, packaged)
    return norm_functions(op, dtype, n, packaged)


def build_lowered(ops, dtypes, sizes, arch: str, verbose: bool = True, packaged=False) -> None:
    """Build the kernels of ``LOWERED_OPS`` by lowering their functions for CUDA."""
    start = time.perf_counter()
    for op in ops:
        for dtype in dtypes:
            for n in sizes:
                for fn, args in lowered_functions(op, dtype, n, packaged):
                    lower_for_cuda(fn, args, arch)
                if verbose:
                    print(f"{op:10s} {dtype:9s} n={n:<7d} ready", flush=True)
    if verbose:
        print(f"{' '.join(ops)} kernels ready in {time.perf_counter() - start:.1f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m quack_jax.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--arch", default="sm_90a", choices=ARCHS)
    parser.add_argument("--cache", help="cache folder (default: $QUACK_JAX_CACHE or ~/.cache)")
    choices = [*OPS, *LOWERED_OPS]
    parser.add_argument("--ops", nargs="+", default=choices, choices=choices)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--sizes", nargs="+", type=int, help="row lengths n")
    parser.add_argument(
        "--packaged",
        action="store_true",
        help="the kernels shipped in the wheel (quack_jax/cubins), for COMMON_MODELS",
    )
    parser.add_argument(
        "--candidates",
        action="store_true",
        help="also the alternative tilings the benchmark tuner tries",
    )
    args = parser.parse_args(argv)
    if args.packaged:
        from ._cache import PACKAGED

        os.environ["QUACK_JAX_CACHE"] = str(PACKAGED)
        build(configs(list(OPS), DTYPES, COMMON_SEQUENCES), args.arch)
        hidden, vocab = (sorted(set(sizes)) for sizes in zip(*COMMON_MODELS.values(), strict=True))
        build_lowered(["rms_norm", "layer_norm"], DTYPES, hidden, args.arch, packaged=True)
        build_lowered(["cross_entropy"], DTYPES, vocab, args.arch, packaged=True)
        return
    if not args.sizes:
        parser.error("--sizes is required (or --packaged)")
    if args.cache:
        os.environ["QUACK_JAX_CACHE"] = args.cache
    softmax_ops = [op for op in args.ops if op in OPS]
    build(configs(softmax_ops, args.dtypes, args.sizes, args.candidates), args.arch)
    lowered = [op for op in args.ops if op in LOWERED_OPS]
    if lowered:
        build_lowered(lowered, args.dtypes, args.sizes, args.arch)


if __name__ == "__main__":
    main()
