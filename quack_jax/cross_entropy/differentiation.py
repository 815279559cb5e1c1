"""How ``jax.grad`` and ``jax.jvp`` reach the cross-entropy kernels: ``custom_jvp``s whose
tangents are linear in the logits' tangent, so that reverse mode transposes them and
forward mode runs them.

Per-row losses (reduction "none", or lse wanted): the tangent is the ``tangent``
primitive, whose transpose is the backward kernel, which reads the logits again once the
cotangents are known. A sum or mean alone: its rows' cotangents are known up to one
scalar factor in the forward, which writes the gradient from the row in registers; the
tangent is its inner product with the logits' tangent, whose transpose scales it (a
multiply by 1 under jax.grad, which XLA removes)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._primitive import compute_dtype
from .formulas import reduce, row_weights
from .forward import bind_forward
from .options import CrossEntropyOptions
from .tangent import tangent


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def per_row(logits, labels, options: CrossEntropyOptions, entropy: bool):
    """The rows' loss and lse, and with ``entropy`` their softmax entropy."""
    loss, shift, logsum, *h = bind_forward(logits, labels, options, entropy=entropy)
    return (loss, shift + logsum, *h)


@per_row.defjvp
def _per_row_jvp(options, entropy, primals, tangents):
    logits, labels = primals
    loss, shift, logsum, *h = bind_forward(logits, labels, options, entropy=entropy)
    t = tangent.bind(
        tangents[0], logits, labels, shift, logsum, *h, options=options, entropy=entropy
    )
    return (loss, shift + logsum, *h), tuple(t)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def reduced(logits, labels, options: CrossEntropyOptions, mean: bool):
    """The sum (or with ``mean`` the mean) of the rows' losses."""
    loss, *_ = bind_forward(logits, labels, options)
    return reduce(loss, labels, options.ignore_index, mean)


@reduced.defjvp
def _reduced_jvp(options, mean, primals, tangents):
    logits, labels = primals
    weights = row_weights(labels, options.ignore_index, mean)
    loss, _, _, dlogits = bind_forward(logits, labels, options, weights)
    dtype = compute_dtype(logits.dtype)
    t = jnp.sum(dlogits.astype(dtype) * tangents[0].astype(dtype))
    return reduce(loss, labels, options.ignore_index, mean), t
