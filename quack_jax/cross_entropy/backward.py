"""The cross-entropy backward primitive: (logits, labels, shift, logsum, a, b, c, [d]) ->
dlogits, from the row statistics and per-row coefficients (``formulas.coefficients``),
which fold in the cotangents and the options. With ``entropy`` the coefficient d of the
entropy's term; with ``inplace`` dlogits is written over the logits (one buffer for
both, for callers whose logits are a temporary: linear + cross-entropy)."""

from __future__ import annotations

import jax.numpy as jnp

from .._partition import ROWS, STAT
from .._primitive import RowwisePrimitive, Target, kernel_call, row_tiling
from .config import CrossEntropyBackward
from .formulas import tempered
from .tilings import CE_BWD


def reference_backward(logits, labels, shift, logsum, a, b, c, *d, options, entropy, inplace):
    z, x = tempered(logits, options)
    u = z - shift[..., None]
    p = jnp.exp(u - logsum[..., None])
    a, b, c, *d = (v[..., None] for v in (a, b, c, *d))
    hit = jnp.arange(x.shape[-1]) == labels[..., None]
    dx = jnp.where(a == 0, 0.0, a * p) - c - jnp.where(hit, b, 0.0)
    if entropy:
        dx = dx + jnp.where(p == 0, 0.0, d[0] * p * u)
    dx = dx / options.temperature
    cap = options.logit_softcap
    if cap is not None:
        dead = (a == 0) & (b == 0) & (c == 0) & (d[0] == 0 if entropy else True)
        dx = jnp.where(dead, 0.0, dx * (1.0 - (x / cap) ** 2))
    return [dx.astype(logits.dtype)]


def _backward_kernel(target: Target, avals_in, avals_out, *, options, entropy, inplace):
    x = avals_in[0]
    tiling = row_tiling(x, CE_BWD)
    if tiling is None:
        return None
    config = CrossEntropyBackward.of(options, entropy=entropy)
    aliases = {0: 0} if inplace else None
    return kernel_call(target, config, x, tiling, avals_out, cluster=False, aliases=aliases)


def backward_split(row, *, options, entropy, inplace):
    """The backward on one device's slice of the vocabulary (``row``): the label's column
    counted from the slice."""

    def local(logits, labels, *stats_and_coefficients):
        here = labels - row.start(logits.shape[-1])
        return backward.bind(
            logits, here, *stats_and_coefficients, options=options, entropy=entropy, inplace=inplace
        )

    return local


backward = RowwisePrimitive(
    "quack_jax_cross_entropy_backward",
    kernel=_backward_kernel,
    reference=reference_backward,
    roles=lambda *, entropy, **_: ((ROWS,) + (STAT,) * (6 + entropy), (ROWS,)),
    split=backward_split,
)
