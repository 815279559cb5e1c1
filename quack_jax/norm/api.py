"""``rms_norm`` and ``layer_norm``, and their differentiation.

A custom_jvp whose tangent is the linear tangent primitive: ``jax.jvp`` runs the forward
kernel and XLA's tangent, ``jax.grad`` the forward kernel and (the tangent's transpose)
the backward kernel, with the cotangent of h (prenorm) added in it; at the shapes of
``rules.norm_pair_on_xla`` the forward and backward lower to XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._checks import float_array
from .._implementation import use_xla
from .._partition import varying_like
from .forward import forward, reference_forward
from .options import NormOptions
from .tangent import tangent


def _outputs(forward_fn, x, residual, weight, bias, options: NormOptions, differentiated=False):
    """The public results and the backward's residuals (h, stats), by ``forward_fn`` (the
    primitive's bind or its reference); ``differentiated``: under autodiff, where the
    statistics feed the backward (the lowering's choice of path reads it)."""
    operands = [a for a in (x, residual, weight, bias) if a is not None]
    outs = forward_fn(
        *operands,
        rms=options.rms,
        eps=options.eps,
        weight_offset=options.weight_offset,
        out_dtype=options.out_dtype,
        residual=residual is not None,
        weight=weight is not None,
        bias=bias is not None,
        differentiated=differentiated,
    )
    y, stats = outs[0], outs[1 + (residual is not None) :]
    h = x if residual is None else outs[1]
    return ((y, h) if options.prenorm else y), h, stats


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _norm(x, residual, weight, bias, options: NormOptions):
    return _outputs(forward.bind, x, residual, weight, bias, options)[0]


@_norm.defjvp
def _norm_jvp(options: NormOptions, primals, tangents):
    x, residual, weight, bias = primals
    tx, tres, tw, tb = tangents
    out, h, stats = _outputs(forward.bind, x, residual, weight, bias, options, differentiated=True)
    th = tx if residual is None else tx + tres
    operands = [a for a in (th, tw, tb, h, weight) if a is not None]
    ty = tangent.bind(
        *operands,
        *stats,
        rms=options.rms,
        weight_offset=options.weight_offset,
        out_dtype=options.out_dtype,
        weight=weight is not None,
        bias=bias is not None,
        prenorm=options.prenorm,
    )
    return out, (tuple(ty) if options.prenorm else ty[0])


def _vector(fn: str, name: str, v, x):
    if v is None:
        return None
    v = float_array(fn, name, v)
    n = x.shape[-1]
    if v.shape != (n,):
        raise ValueError(f"{fn}: {name} must have shape ({n},) to match x, got {v.shape}")
    if v.dtype not in (jnp.float32, x.dtype):
        raise TypeError(
            f"{fn}: {name} must be float32 or x's dtype ({x.dtype.name}), got {v.dtype.name}"
        )
    return v


def _apply(fn, rms, x, weight, bias, residual, implementation, **options):
    x = float_array(fn, "x", x)
    weight = _vector(fn, "weight", weight, x)
    bias = _vector(fn, "bias", bias, x)
    if residual is not None:
        residual = float_array(fn, "residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"{fn}: residual must have x's shape {x.shape}, got {residual.shape}")
        if residual.dtype != x.dtype:
            raise TypeError(
                f"{fn}: residual must have x's dtype {x.dtype.name}, got {residual.dtype.name}"
            )
    options = NormOptions.of(fn, rms, x, has_weight=weight is not None, **options)
    weight, bias = (varying_like(x, v) for v in (weight, bias))
    if use_xla(fn, implementation):
        return _outputs(reference_forward, x, residual, weight, bias, options)[0]
    return _norm(x, residual, weight, bias, options)


def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    residual: jax.Array | None = None,
    prenorm: bool = False,
    weight_offset: float = 0.0,
    out_dtype=None,
    implementation: str | None = None,
):
    """RMSNorm over the last axis: ``h * rsqrt(mean(h**2) + eps) * (weight + weight_offset)``.

    Args:
      x: array of any rank >= 1, float32, bfloat16 or float16 (float64 runs the XLA
        reference). Math is in float32.
      weight: optional scale of shape (n,), float32 or x's dtype.
      eps: added to the mean square; a positive Python float.
      residual: optional array of x's shape and dtype; then ``h = x + residual`` (rounded
        to x's dtype, as the unfused add would be), else ``h = x``.
      prenorm: also return h, the residual stream of a pre-norm block.
      weight_offset: added to the weight (1.0 for Gemma's ``(1 + w)`` scaling).
      out_dtype: dtype of the result (default x's); float64 is float32, with JAX's
        warning, unless x64 is enabled.
      implementation: None (the kernels on a CUDA sm_90 device, except at small shapes,
        which lower to XLA's formulation where that measured faster: the forward up to
        32 MiB of input, and RMSNorm's over rows of at most 256 elements, outside
        autodiff; under autodiff the forward with the backward, RMSNorm's from 8 rows
        over rows of at least 4096 elements up to 1 MiB, LayerNorm's from 64 rows up to
        2 MiB; the XLA fallback elsewhere) or "xla": a plain jnp formulation
        that JAX differentiates, with no quack_jax primitive in the program (to bisect a
        numerics difference).
        None follows ``$QUACK_JAX_IMPLEMENTATION`` (``xla`` or unset), read at trace
        time.

    Returns:
      y, or ``(y, h)`` with ``prenorm``. ``jax.grad`` runs one backward kernel for dx
      (and the residual's gradient, the same array) and the weight gradient, reduced
      over all rows without atomics, so it is the same on every run. ``jax.jvp`` runs
      the forward kernel and the tangent in XLA; any order of derivative works. At the
      smallest shapes (see ``implementation``) the forward and backward under autodiff
      are XLA's formulation instead of the kernels.
    """
    return _apply(
        "rms_norm",
        True,
        x,
        weight,
        None,
        residual,
        implementation,
        eps=eps,
        weight_offset=weight_offset,
        out_dtype=out_dtype,
        prenorm=prenorm,
    )


def layer_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    residual: jax.Array | None = None,
    prenorm: bool = False,
    weight_offset: float = 0.0,
    out_dtype=None,
    implementation: str | None = None,
):
    """LayerNorm over the last axis:
    ``(h - mean) * rsqrt(var + eps) * (weight + weight_offset) + bias``.

    The variance is the mean squared deviation from the mean (not ``E[h^2] - mean^2``).
    Arguments as for :func:`rms_norm`, plus ``bias`` of shape (n,), float32 or x's dtype.
    """
    return _apply(
        "layer_norm",
        False,
        x,
        weight,
        bias,
        residual,
        implementation,
        eps=eps,
        weight_offset=weight_offset,
        out_dtype=out_dtype,
        prenorm=prenorm,
    )
