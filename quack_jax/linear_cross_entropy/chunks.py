"""The chunked computation on one device's block of rows (and, on a vocabulary split,
its slice of the vocabulary): for each chunk of rows, its logits from the GEMM, the
cross-entropy over them (``cross_entropy.forward`` or ``backward``), and its share of
the gradients (docs/decisions/017-linear-cross-entropy-chunks.md)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from .._partition import WHOLE, varying_like
from .._primitive import compute_dtype
from ..cross_entropy.backward import backward_split
from ..cross_entropy.forward import forward_split

# the per-row results of the forward: the loss and the row statistics (see
# ``cross_entropy``), and with ``entropy`` the rows' entropy (linear_token_logprobs)
STATS = ("loss", "shift", "logsum")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Needs:
    """Which gradients autodiff asks for: of h, of the weight, of the bias."""

    h: bool
    weight: bool
    bias: bool


def stat_names(entropy: bool) -> tuple[str, ...]:
    return STATS + ("entropy",) * entropy


def unpack(operands, has_bias):
    """(h, weight, bias or None, labels, [per-row operands])."""
    h, w, *rest = operands
    bias = rest.pop(0) if has_bias else None
    return h, w, bias, rest[0], rest[1:]


def gradient_names(mode, needs):
    if mode == "loss":
        return ()
    return tuple(
        k for k, on in zip(("dh", "dw", "db"), dataclasses.astuple(needs), strict=True) if on
    )


def chunked(*operands, mode, needs, has_bias, linear, options, entropy, row=WHOLE, data_axes=()):
    """The op on operands whose rows (and, with ``row``, vocabulary slice) are this
    device's; ``data_axes`` are the mesh axes that split the rows, over which dW and the
    bias gradient are summed. Results: [loss, shift, logsum] (the row statistics, see
    cross_entropy.py) and with ``entropy`` the rows' entropy (not in "backward"), then the
    gradients in ``needs``: dh (h's dtype), dW and db (float32)."""
    h, w, bias, labels, per_row = unpack(operands, has_bias)
    lead, d = labels.shape, h.shape[-1]
    h, labels = h.reshape(-1, d), labels.reshape(-1)
    per_row = [p.reshape(-1) for p in per_row]
    t, stat = h.shape[0], compute_dtype(linear.preferred_element_type)
    grads = gradient_names(mode, needs)
    vocab = linear.vocab(w)
    # the GEMMs' weight (and bias), padded where the vocabulary is misaligned; the
    # cross-entropy sees the logits of the vocabulary alone
    w, bias = linear.padded(w, bias)
    padding = linear.vocab(w) - vocab
    stats = stat_names(entropy)
    shapes = {k: ((t,), stat) for k in stats} | {"dh": ((t, d), h.dtype)}
    shapes |= {"dw": (w.shape, jnp.float32), "db": ((vocab + padding,), jnp.float32)}
    # zeros that vary over shard_map's axes as the chunks' results do; dW and db are
    # written by the first chunk
    results = stats * (mode != "backward") + ("dh",) * ("dh" in grads)
    carry = {k: varying_like(h, jnp.zeros(*shapes[k])) for k in results}

    # ceil(t / chunk) chunks of equal size; when that size does not divide t, the last
    # chunk ends at row t and overlaps the one before it: its rows already done get zero
    # gradient coefficients, and their dh is kept
    chunks = -(-t // linear.chunk_size)
    size = -(-t // chunks) if t else 0

    def step(i, carry):
        start = jnp.minimum(i * size, t - size)
        fresh = start + jnp.arange(size) >= i * size

        def rows(a):
            return lax.dynamic_slice_in_dim(a, start, size)

        hc = rows(h)
        logits = linear.logits(hc, w, bias)
        logits = logits[:, :vocab] if padding else logits
        # the per-row gradient coefficients: the weights in "grad"; a, b, c after the
        # statistics in "backward"
        kept = 2 if mode == "backward" else 0
        coefficients = [jnp.where(fresh, rows(p), 0) for p in per_row[kept:]]
        inputs = (logits, rows(labels), *map(rows, per_row[:kept]), *coefficients)
        if mode == "backward":
            split = backward_split(row, options=options, entropy=entropy, inplace=True)
            (dlogits,) = split(*inputs)
        else:
            grad = mode == "grad"
            split = forward_split(row, options=options, entropy=entropy, grad=grad, inplace=grad)
            outs = split(*inputs)
            carry = dict(carry)
            for k, v in zip(stats, outs, strict=False):
                carry[k] = lax.dynamic_update_slice_in_dim(carry[k], v.astype(stat), start, 0)
            if not grads:
                return carry
            (dlogits,) = outs[len(stats) :]
        dlogits = dlogits.astype(h.dtype)
        dlogits = jnp.pad(dlogits, ((0, 0), (0, padding))) if padding else dlogits
        carry = dict(carry)
        if "dh" in grads:
            dh = linear.dh(dlogits, w)
            dh = jax.lax.psum(dh, row.axes) if row.axes else dh
            dh = jnp.where(fresh[:, None], dh.astype(h.dtype), rows(carry["dh"]))
            carry["dh"] = lax.dynamic_update_slice_in_dim(carry["dh"], dh, start, 0)
        sums = {}
        if "dw" in grads:
            sums["dw"] = linear.dw(hc, dlogits)
        if "db" in grads:
            sums["db"] = jnp.sum(dlogits, axis=0, dtype=jnp.float32)
        # the first chunk writes dW and db, the others add to them
        return carry | {k: carry[k] + v if k in carry else v for k, v in sums.items()}

    if size:
        carry = lax.fori_loop(1, chunks, step, step(0, carry))
    else:
        carry |= {k: varying_like(h, jnp.zeros(*shapes[k])) for k in grads if k not in carry}
    if padding and "dw" in carry:  # of the vocabulary alone, then summed over devices
        axis = 0 if linear.transpose_weight else 1
        carry["dw"] = lax.slice_in_dim(carry["dw"], 0, vocab, axis=axis)
    if padding and "db" in carry:
        carry["db"] = carry["db"][:vocab]
    for k in ("dw", "db"):
        if k in carry and data_axes:
            carry[k] = jax.lax.psum(carry[k], data_axes)
    outs = [] if mode == "backward" else [carry[k].reshape(lead) for k in stats]
    for k in grads:
        outs.append(carry[k].reshape(*lead, d) if k == "dh" else carry[k])
    return outs
