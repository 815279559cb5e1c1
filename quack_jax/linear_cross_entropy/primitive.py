"""The linear + cross-entropy primitive: (h, weight, [bias], labels, [per-row operands])
-> the per-row results and the gradients that autodiff asks for. ``mode`` is "loss"
(the per-row results), "grad" (also the gradients of a weighted sum of the losses, in
the forward pass), "backward" (the gradients from per-row coefficients, each chunk's
logits made again) or "token_loss" (a ``TokenLoss``'s values per row, and the gradients
of their sum, in the forward pass; the per-row operands are its arguments). Its
lowering is the chunked loop (``chunks.py``), partitioned under a sharded ``jit``
(``partition.py``); off the GPU the same chunks run through the XLA references, so the
memory saving holds everywhere."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import batching, mlir

from .._jax_private import new_primitive
from .._partition import STAT, role_aval
from .._primitive import compute_dtype
from .chunks import gradient_names, row_names, unpack
from .partition import partitioned


def _abstract(*avals, mode, needs, has_bias, linear, options, entropy, token_loss):
    h, w, bias, _, _ = unpack(avals, has_bias)
    stat = role_aval(h, STAT, compute_dtype(linear.preferred_element_type))
    grad = {
        "dh": h.update(weak_type=False),
        "dw": w.update(dtype=np.dtype("float32"), weak_type=False),
    }
    if bias is not None:
        grad["db"] = bias.update(dtype=np.dtype("float32"), weak_type=False)
    outs = [stat] * len(row_names(mode, entropy))
    return outs + [grad.get(k, stat) for k in gradient_names(mode, needs)]


def _batch(operands, dims, *, mode, needs, has_bias, **params):
    """A batch of token rows becomes a leading row axis. Per-example weight gradients,
    or a batched weight or bias, run the examples one after another (``lax.map``)."""
    size = next(x.shape[d] for x, d in zip(operands, dims, strict=True) if d is not None)
    params = dict(mode=mode, needs=needs, has_bias=has_bias, **params)
    shared = range(1, 2 + has_bias)  # the weight and the bias

    def leading(x, d):
        return jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)

    if any(dims[i] is not None for i in shared) or (
        mode != "loss" and (needs.weight or needs.bias)
    ):
        ops = [leading(x, d) for x, d in zip(operands, dims, strict=True)]
        outs = lax.map(lambda ops: tuple(primitive.bind(*ops, **params)), ops)
    else:
        ops = [
            x if i in shared else leading(x, d)
            for i, (x, d) in enumerate(zip(operands, dims, strict=True))
        ]
        outs = primitive.bind(*ops, **params)
    return list(outs), [0] * len(outs)


def _lower(ctx, *operands, **params):
    fn = partitioned(params, ctx.avals_in, ctx.avals_out)
    return mlir.lower_fun(lambda *ops: list(fn(*ops)), multiple_results=True)(ctx, *operands)


primitive = new_primitive("quack_jax_linear_cross_entropy")
primitive.def_abstract_eval(_abstract)
batching.primitive_batchers[primitive] = _batch
mlir.register_lowering(primitive, _lower)


def bind(mode, needs, h, w, bias, labels, *per_row, linear, options, entropy, token_loss=None):
    """The primitive of ``mode`` on h, the weight, the bias (or None), the labels and the
    per-row operands."""
    operands = (h, w) + ((bias,) if bias is not None else ()) + (labels, *per_row)
    return primitive.bind(
        *operands,
        mode=mode,
        needs=needs,
        has_bias=bias is not None,
        linear=linear,
        options=options,
        entropy=entropy,
        token_loss=token_loss,
    )
