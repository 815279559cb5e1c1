"""What the norms declare for the tools: the functions whose lowering builds their
kernels, their benchmarks and their test grid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._spec import FWD_COLUMNS, TILINGS, Benchmark, Case, OpSpec, Shapes, Tuned, fwd_bwd
from .api import layer_norm, rms_norm
from .backward import backward as backward_primitive
from .backward import backward_live
from .config import NormBackward, NormForward
from .forward import forward_live
from .rules import QK_NORM_SIZES
from .tilings import backward_family, forward_family

# QK-norm's rows (tokens x heads) of each head size, for ``--latency``
QK_NORM_SHAPES = tuple((m, n) for n in QK_NORM_SIZES for m in (32768, 262144, 2097152))

NORM_MIXES = ((False, False), (True, False), (True, True))  # (residual, prenorm)


def _lowerings(op: str, dtype: str, n: int, packaged: bool):
    """Forward and backward (``jax.vjp``) of ``op`` for the usual operand mixes: no weight,
    or weights in x's dtype or float32; no residual, a residual, a pre-norm one.
    ``packaged``: weights in x's dtype or float32, no residual or a pre-norm one."""
    apply = rms_norm if op == "rms_norm" else layer_norm
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

            row = jax.ShapeDtypeStruct((8, n), dtype)
            yield fn, (row, params, row if residual else None, row)


def _benchmarks():
    """Each norm with a float32 weight (and bias) of shape (N,) and y in x's dtype:
    forward, and ``jax.vjp`` w.r.t. x, weight and bias that also returns y; against a
    plain jnp formulation (float32 math, rsqrt, LayerNorm with the centred variance) and
    Flax's ``nn.RMSNorm`` / ``nn.LayerNorm`` (dtype x's, float32 params, the same epsilon;
    its columns stay empty without Flax). The arguments are x, weight, [bias], dy."""
    return [_benchmark("rms_norm", True), _benchmark("layer_norm", False)]


def _benchmark(name: str, rms: bool):
    try:
        import flax.linen as nn
    except ImportError:
        nn = None
    eps = 1e-6
    shapes = [(32768, 1024), (16384, 4096), (8192, 8192), (4096, 16384), (2048, 65536)]
    quick = [(1024, 1024), (128, 8192)]  # fwd+bwd in bfloat16 is slow on a CPU

    def statistics(x):
        """x in float32 (centred for LayerNorm), its per-row rstd and mean."""
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1)
        centred = x32 if rms else x32 - mean[..., None]
        return centred, lax.rsqrt(jnp.mean(centred * centred, axis=-1) + eps), mean

    def quack_fn(x, *params):
        return (rms_norm if rms else layer_norm)(x, *params, eps=eps)

    def xla_fn(x, weight, bias=None):
        centred, rstd, _ = statistics(x)
        y = centred * rstd[..., None] * weight
        return (y if bias is None else y + bias).astype(x.dtype)

    def flax_fn(x, weight, bias=None):
        params = {"scale": weight} | ({} if bias is None else {"bias": bias})
        module = (nn.RMSNorm if rms else nn.LayerNorm)(
            epsilon=eps, dtype=x.dtype, param_dtype=jnp.float32
        )
        return module.apply({"params": params}, x)

    flags = dict(weight=True, dh=False, weight_grad=True, bias_grad=not rms)

    def backward(*operands):
        return backward_primitive.bind(*operands, rms=rms, weight_offset=0.0, **flags)

    def backward_operands(x, weight, *rest):
        _, rstd, mean = statistics(x)
        return (rest[-1], x, weight, rstd) + (() if rms else (mean,))

    refs = [("xla", "XLA", xla_fn)] + [("flax", "Flax", flax_fn)] * (nn is not None)
    return Benchmark(
        name,
        shapes,
        quick,
        arguments=lambda m, n, dtype: (
            [((m, n), dtype)] + [((n,), "float32")] * (1 if rms else 2) + [((m, n), dtype)]
        ),
        cases=[
            Case("quack_fwd", "quack_jax fwd", 2, quack_fn, -1, kernel=True),
            Case("xla_fwd", "XLA fwd", 2, xla_fn, -1),
            Case("quack_fwd_bwd", "quack_jax fwd+bwd", 5, fwd_bwd(quack_fn), kernel=True),
        ]
        + [Case(f"{k}_fwd_bwd", f"{label} fwd+bwd", 5, fwd_bwd(f)) for k, label, f in refs],
        tuned=[
            Tuned(
                "fwd",
                forward_family(rms),
                2,
                quack_fn,
                lambda *args: args[:-1],
                lambda: forward_live(residual=False, weight=True, bias=not rms),
                1,
                True,
            ),
            Tuned(
                "bwd",
                backward_family(rms),
                3,
                backward,
                backward_operands,
                lambda: backward_live(**flags),
                2,
            ),
        ],
        columns=[
            *FWD_COLUMNS,
            ("quack fwd+bwd TB/s", "rate", "quack_fwd_bwd"),
            ("XLA fwd+bwd TB/s", "rate", "xla_fwd_bwd"),
            ("Flax fwd+bwd TB/s", "rate", "flax_fwd_bwd"),
            ("speedup vs XLA", "speedup", "xla_fwd_bwd", "quack_fwd_bwd"),
            ("speedup vs Flax", "speedup", "flax_fwd_bwd", "quack_fwd_bwd"),
            TILINGS,
        ],
        footprint=8,
        latency_shapes=Benchmark.latency((1024, 2048, 4096, 8192))
        + list(QK_NORM_SHAPES if rms else ()),
    )


SPEC = OpSpec(
    ops=("rms_norm", "layer_norm"),
    configs=(NormForward, NormBackward),
    sizes="hidden",
    lowerings=_lowerings,
    tests={
        "cpu": Shapes(rows=(1, 3), sizes=(1, 7, 128, 1000, 5000), special=(40,)),
        "gpu": Shapes(
            rows=(1, 3, 1000, 16384),
            sizes=(1, 7, 128, 1000, 4096, 5120, 8192, 16384, 65536),
            special=(7, 1024, 65536),
        ),
    },
    benchmarks=_benchmarks,
)
