"""What the norm primitives share: their optional operands, batching, and the
normalised rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split(operands, *flags):
    """The optional operands in order, None where a flag is unset, then the rest."""
    rest = list(operands)
    return [rest.pop(0) if flag else None for flag in flags] + rest


def vmapped(reference, operands, dims, params):
    out = jax.vmap(lambda *a: list(reference(*a, **params)), in_axes=list(dims))(*operands)
    return out, [0] * len(out)


def fold(operands, dims, vectors):
    """Operands with the batch axis first (broadcast where absent), except the vectors."""
    size = next(x.shape[d] for x, d in zip(operands, dims, strict=True) if d is not None)
    return [
        x
        if i in vectors
        else jnp.broadcast_to(x, (size, *x.shape))
        if d is None
        else jnp.moveaxis(x, d, 0)
        for i, (x, d) in enumerate(zip(operands, dims, strict=True))
    ]


def centred(h, mean, ct):
    """h in the compute dtype ``ct`` less its row's mean (None for RMSNorm: h itself)."""
    h = h.astype(ct)
    return h if mean is None else h - mean[..., None]


def normalised(h, rstd, mean):
    return centred(h, mean, rstd.dtype) * rstd[..., None]


def parameter_grads(dy, xhat, axes, weight_grad, bias_grad):
    """The weight and bias gradients (those asked for): dy * xhat and dy summed over ``axes``."""
    axes = tuple(axes)
    return [jnp.sum(dy * xhat, axis=axes)] * weight_grad + [jnp.sum(dy, axis=axes)] * bias_grad
