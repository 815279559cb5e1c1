"""What the norms declare for the tools: the functions whose lowering builds their
kernels, their benchmarks and their test grid."""

from __future__ import annotations

import dataclasses
import itertools

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


@dataclasses.dataclass(frozen=True)
class Mix:
    """A norm call's operands and options: weight and bias dtypes ("x": x's; rms_norm
    takes no bias), a residual, prenorm, weight_offset, eps and out_dtype (None: x's)."""

    weight: str | None = None
    bias: str | None = None
    residual: bool = False
    prenorm: bool = False
    offset: float = 0.0
    eps: float = 1e-5
    out: str | None = None

    def dtypes(self, op: str, dtype: str):
        """The weight's, the bias's and y's dtypes for x of ``dtype``."""
        weight = dtype if self.weight == "x" else self.weight
        bias = None if op == "rms_norm" else dtype if self.bias == "x" else self.bias
        return weight, bias, self.out or dtype


# every mix of the kernels' operands: no weight, or one in x's dtype or float32, the bias
# none or as the weight; no residual, a residual, a pre-norm one; y in x's dtype or float32
OPERAND_MIXES = tuple(
    Mix(weight=w, bias=b, residual=r, prenorm=p, out=o)
    for w, b, (r, p), o in itertools.product(
        (None, "float32", "x"), (None, "float32", "x"), NORM_MIXES, (None, "float32")
    )
    if b is None or b == w
)
# the usual ones: the bias as the weight, y in x's dtype
USUAL_MIXES = tuple(m for m in OPERAND_MIXES if m.bias == m.weight and m.out is None)
# named mixes of operands and options, beyond the usual ones (mixed parameter dtypes, a
# bias without a weight, y in bfloat16) and with weight_offset and eps
MIXES = {
    "plain": Mix(),
    "weight_residual_prenorm": Mix(weight="x", residual=True, prenorm=True, offset=0.5),
    "fp32_params_offset": Mix(weight="float32", bias="float32", offset=1.0),
    "residual_fp32_out": Mix(weight="x", bias="x", residual=True, out="float32"),
    "bias_residual_eps": Mix(bias="float32", residual=True, eps=0.5),
    "mixed_params_prenorm_bf16_out": Mix(weight="float32", bias="x", prenorm=True, out="bfloat16"),
    "all": Mix(
        weight="float32",
        bias="float32",
        residual=True,
        prenorm=True,
        offset=1.0,
        eps=1e-3,
        out="float32",
    ),
}
# the gpu tests' row lengths at which they run every mix of ``OPERAND_MIXES``; at the
# others, the usual ones and the named ones
MIX_SIZES = (7, 1000, 4096, 65536)


def forward(op: str, mix: Mix):
    """(x, weight, bias, residual) -> y, or (y, h) with prenorm."""
    apply = rms_norm if op == "rms_norm" else layer_norm

    def f(x, w, b, r):
        params = (w,) if op == "rms_norm" else (w, b)
        options = dict(prenorm=mix.prenorm, weight_offset=mix.offset, out_dtype=mix.out)
        return apply(x, *params, residual=r, eps=mix.eps, **options)

    return f


def forward_backward(op: str, mix: Mix):
    """(x, weight, bias, residual, dy, dh) -> (y or (y, h), (dx, dweight, dbias,
    dresidual)) through ``jax.vjp``."""

    def fn(x, w, b, r, dy, dh):
        out, vjp = jax.vjp(forward(op, mix), x, w, b, r)
        return out, vjp((dy, dh) if mix.prenorm else dy)

    return fn


def structs(op: str, shape: tuple[int, ...], dtype: str, mix: Mix, batch: int = 0) -> list:
    """Shape-dtype structs of (x, weight, bias, residual, dy, dh), None where absent;
    with ``batch``, the rows' operands have a leading axis of that size."""
    weight, bias, out = mix.dtypes(op, dtype)
    rows = (batch, *shape) if batch else shape
    row = jax.ShapeDtypeStruct(rows, dtype)
    return [
        row,
        None if weight is None else jax.ShapeDtypeStruct(shape[-1:], weight),
        None if bias is None else jax.ShapeDtypeStruct(shape[-1:], bias),
        row if mix.residual else None,
        jax.ShapeDtypeStruct(rows, out),
        row if mix.prenorm else None,
    ]


def _lowerings(op: str, dtype: str, n: int, packaged: bool):
    """Forward and backward (``jax.vjp``) of ``op`` for the usual and the named mixes
    (``USUAL_MIXES``, ``MIXES``), and at ``MIX_SIZES`` for every one of
    ``OPERAND_MIXES`` and, under ``jax.vmap``, for the usual ones (whose backward
    kernels write no parameter gradients: XLA sums them over the batch). ``packaged``:
    weights in x's dtype or float32, no residual or a pre-norm one."""
    if packaged:
        yield from _packaged(op, dtype, n)
        return
    mixes = USUAL_MIXES + tuple(MIXES.values()) + (OPERAND_MIXES if n in MIX_SIZES else ())
    for mix in dict.fromkeys(mixes):
        yield forward_backward(op, mix), tuple(structs(op, (8, n), dtype, mix))
    for mix in USUAL_MIXES if n in MIX_SIZES else ():
        batched = jax.vmap(forward_backward(op, mix), in_axes=(0, None, None, 0, 0, 0))
        yield batched, tuple(structs(op, (8, n), dtype, mix, batch=2))


def _packaged(op: str, dtype: str, n: int):
    apply = rms_norm if op == "rms_norm" else layer_norm
    for param_dtype in (dtype, "float32"):
        vec = jax.ShapeDtypeStruct((n,), param_dtype)
        params = (vec,) * (1 if op == "rms_norm" else 2)
        for residual, prenorm in NORM_MIXES[::2]:

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
            others=MIX_SIZES,
        ),
    },
    benchmarks=_benchmarks,
)
