"""The linear + cross-entropy primitive: (h, weight, [bias], labels, [kept logits],
[per-row operands]) -> the per-row results and the gradients that autodiff asks for.
``mode`` is "loss" (the per-row results, and over vocabulary ``slices`` the logits of
those kept), "grad" (also the gradients of a weighted sum of the losses, in the forward
pass), "backward" (the gradients from per-row coefficients, over vocabulary ``slices``
whose kept logits follow the labels, or in chunks of rows whose logits are made again)
or "token_loss" (a ``TokenLoss``'s values per row, and the gradients of their sum, in
the forward pass; the per-row operands are its arguments). Its lowering is the loop over
slices (``slices.py``) or chunks (``chunks.py``), partitioned under a sharded ``jit``
(``partition.py``); off the GPU the same loops run through the XLA references, so the
memory saving holds everywhere."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import batching, mlir

from .._jax_private import new_primitive
from .._partition import STAT, names, role_aval
from .._primitive import compute_dtype
from .chunks import dw_dtype, gradient_names, result_names, unpack
from .partition import partitioned


def _logits_aval(h, w, linear, width):
    """Logits (*rows, width) in the logits' dtype; under explicit sharding split as h's
    rows and the weight's vocabulary (unless that axis already splits the rows)."""
    axis = 0 if linear.transpose_weight else 1
    rows = (tuple(h.sharding.spec) + (None,) * h.ndim)[: h.ndim - 1]
    vocab = (tuple(w.sharding.spec) + (None,) * 2)[axis]
    taken = {a for r in rows for a in names(r)}
    return h.update(
        shape=(*h.shape[:-1], width),
        dtype=np.dtype(linear.preferred_element_type),
        weak_type=False,
        sharding=h.sharding.update(spec=(*rows, None if taken & set(names(vocab)) else vocab)),
    )


def _abstract(*avals, mode, needs, has_bias, linear, options, entropy, token_loss, slices):
    h, w, bias, _, _, _ = unpack(avals, has_bias, mode, slices)
    stat = role_aval(h, STAT, compute_dtype(linear.preferred_element_type))
    made = {
        "dh": h.update(weak_type=False),
        "dw": w.update(dtype=np.dtype(dw_dtype(mode, slices, w.dtype)), weak_type=False),
    }
    kept = slices.widths[len(slices.widths) - slices.kept :] if slices else ()
    made |= {f"kept{j}": _logits_aval(h, w, linear, width) for j, width in enumerate(kept)}
    if bias is not None:
        made["db"] = bias.update(dtype=np.dtype("float32"), weak_type=False)
    results = result_names(mode, entropy, slices) + gradient_names(mode, needs)
    return [made.get(k, stat) for k in results]


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


def bind(
    mode,
    needs,
    h,
    w,
    bias,
    labels,
    *per_row,
    linear,
    options,
    entropy,
    token_loss=None,
    slices=None,
    kept=(),
):
    """The primitive of ``mode`` on h, the weight, the bias (or None), the labels, the
    logits of the slices that "loss" kept (the backward over ``slices``) and the
    per-row operands."""
    operands = (h, w) + ((bias,) if bias is not None else ()) + (labels,)
    operands += tuple(kept) + per_row
    return primitive.bind(
        *operands,
        mode=mode,
        needs=needs,
        has_bias=bias is not None,
        linear=linear,
        options=options,
        entropy=entropy,
        token_loss=token_loss,
        slices=slices,
    )
