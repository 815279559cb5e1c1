"""The chunked computation on one device's block of rows (and, on a vocabulary split,
its slice of the vocabulary): for each chunk of rows, its logits from the GEMM, the
cross-entropy over them (``cross_entropy.forward`` or ``backward``), and its share of
the gradients (docs/decisions/017-linear-cross-entropy-chunks.md). Per-row losses go
over vocabulary slices instead (``slices.py``) where the rows do not outnumber the
vocabulary. A token loss
(``TokenLoss``) runs both kernels on each chunk's logits, with the per-token cotangents
of its loss function in between (docs/decisions/024-token-loss-in-the-forward.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from .._partition import WHOLE, varying_like
from .._primitive import compute_dtype
from ..cross_entropy.backward import backward_split
from ..cross_entropy.formulas import coefficients, logprob_outputs
from ..cross_entropy.forward import forward_split

# the per-row results of the forward: the loss and the row statistics (see
# ``cross_entropy``), and with ``entropy`` the rows' entropy (linear_token_logprobs)
STATS = ("loss", "shift", "logsum")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Needs:
    """Which gradients autodiff asks for: of h, of the weight, of the bias, and of each
    per-token argument of a token loss."""

    h: bool
    weight: bool
    bias: bool
    args: tuple[bool, ...] = ()


@dataclasses.dataclass(frozen=True)
class TokenLoss:
    """A loss of each token's log-probability and entropy: ``fn(logp, entropy, *args)``
    of one token's scalars (and its per-token arguments) -> a float scalar, which
    ``jax.vmap`` maps over the rows. Hashed by ``fn``'s identity."""

    fn: Callable

    def values(self, logp, entropy, args):
        return jax.vmap(self.fn)(logp, entropy, *args).astype(logp.dtype)

    def cotangents(self, logp, entropy, args, needs: Needs):
        """The rows' values and their derivatives by logp, by the entropy and by each
        argument that ``needs.args`` asks for."""
        wrt = [i for i, on in enumerate(needs.args) if on]

        def values(logp, entropy, *picked):
            full = list(args)
            for i, a in zip(wrt, picked, strict=True):
                full[i] = a
            return self.values(logp, entropy, full)

        value, vjp = jax.vjp(values, logp, entropy, *(args[i] for i in wrt))
        return value, vjp(jnp.ones_like(value))


def stat_names(entropy: bool) -> tuple[str, ...]:
    return STATS + ("entropy",) * entropy


def row_names(mode: str, entropy: bool) -> tuple[str, ...]:
    """The per-row results of ``mode`` before the gradients: the statistics (with the
    entropy), the token loss's values, or none (the backward)."""
    return {"backward": (), "token_loss": ("value",)}.get(mode, stat_names(entropy))


def result_names(mode: str, entropy: bool, slices) -> tuple[str, ...]:
    """The results of ``mode`` before the gradients: ``row_names``, then in "loss" over
    vocabulary ``slices`` the logits of those kept ("kept0", ...)."""
    kept = slices.kept if mode == "loss" and slices else 0
    return row_names(mode, entropy) + tuple(f"kept{j}" for j in range(kept))


def dw_dtype(mode, slices, weight_dtype):
    """dW's dtype: the weight's in the backward over vocabulary slices (its rows'
    cotangents are in dlogits, so nothing scales dW after it), float32 otherwise (it is
    scaled by the cotangent, then cast) (docs/decisions/026-one-chunk-dw-in-weight-dtype.md)."""
    return weight_dtype if mode == "backward" and slices else jnp.float32


def unpack(operands, has_bias, mode, slices):
    """(h, weight, bias or None, labels, [the kept slices' logits], [per-row operands]);
    the backward over vocabulary ``slices`` takes the kept logits after the labels."""
    h, w, *rest = operands
    bias = rest.pop(0) if has_bias else None
    labels = rest.pop(0)
    kept = slices.kept if mode == "backward" and slices else 0
    return h, w, bias, labels, rest[:kept], rest[kept:]


def gradient_names(mode, needs):
    """The gradients ``mode`` makes, in order: dh, dw, db, then the per-token arguments'
    ("darg0", ...) of a token loss."""
    if mode == "loss":
        return ()
    flags = (needs.h, needs.weight, needs.bias)
    names = [k for k, on in zip(("dh", "dw", "db"), flags, strict=True) if on]
    return (*names, *(f"darg{i}" for i, on in enumerate(needs.args) if on))


def chunked(
    *operands,
    mode,
    needs,
    has_bias,
    linear,
    options,
    entropy,
    token_loss,
    row=WHOLE,
    data_axes=(),
):
    """The op on operands whose rows (and, with ``row``, vocabulary slice) are this
    device's; ``data_axes`` are the mesh axes that split the rows, over which dW and the
    bias gradient are summed. Results: the per-row results (``row_names``), then the
    gradients in ``needs``: dh (h's dtype), dW (float32) and db (float32), and the
    per-token arguments' (float32). The backward makes each chunk's logits again."""
    h, w, bias, labels, _, per_row = unpack(operands, has_bias, mode, None)
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
    stats = row_names(mode, entropy)
    shapes = {k: ((t,), stat) for k in stats + grads} | {"dh": ((t, d), h.dtype)}
    shapes |= {"dw": (w.shape, jnp.float32), "db": ((vocab + padding,), jnp.float32)}
    # zeros that vary over shard_map's axes as the chunks' results do; dW and db are
    # written by the first chunk
    results = stats + tuple(k for k in grads if k not in ("dw", "db"))
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

        def store(carry, values):
            return carry | {
                k: lax.dynamic_update_slice_in_dim(carry[k], v.astype(stat), start, 0)
                for k, v in values.items()
            }

        hc = rows(h)
        logits = linear.logits(hc, w, bias)
        logits = logits[:, :vocab] if padding else logits
        if mode == "token_loss":
            values, dlogits = _token_loss_chunk(
                logits,
                rows(labels),
                [rows(p) for p in per_row],
                fresh,
                row=row,
                options=options,
                token_loss=token_loss,
                needs=needs,
                n=vocab * row.count,
                kernel=bool({"dh", "dw", "db"} & set(grads)),
            )
            carry = store(carry, values)
            if dlogits is None:
                return carry
        else:
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
                split = forward_split(
                    row, options=options, entropy=entropy, grad=grad, inplace=grad
                )
                outs = split(*inputs)
                carry = store(carry, dict(zip(stats, outs, strict=False)))
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
            sums["dw"] = linear.dw(hc, dlogits, jnp.float32)
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
    # the per-row results in the rows' shape; dW and db as they are
    lead_shapes = {"dh": (*lead, d), "dw": None, "db": None}
    outs = []
    for k in stats + grads:
        shape = lead_shapes.get(k, lead)
        outs.append(carry[k] if shape is None else carry[k].reshape(shape))
    return outs


def _token_loss_chunk(logits, labels, args, fresh, *, row, options, token_loss, needs, n, kernel):
    """A token loss on one chunk: the forward kernel's log-probabilities and entropies,
    the loss's values, the cotangents of the per-token arguments that ``needs`` asks
    for, and with ``kernel`` the backward kernel's dlogits over the logits (None
    otherwise); ``n`` is the whole vocabulary. Rows already done (not ``fresh``) get no
    second gradient."""
    forward = forward_split(row, options=options, entropy=True, grad=False, inplace=False)
    loss, shift, logsum, entropy = forward(logits, labels)
    logp, entropy_out = logprob_outputs(loss, [entropy], labels, options)
    if not (kernel or any(needs.args)):
        return {"value": token_loss.values(logp, entropy_out, args)}, None
    value, (g_logp, g_entropy, *g_args) = token_loss.cotangents(logp, entropy_out, args, needs)
    picked = [f"darg{i}" for i, on in enumerate(needs.args) if on]
    values = {"value": value} | dict(zip(picked, g_args, strict=True))
    if not kernel:
        return values, None
    # logp is -loss: the loss's cotangent is -g_logp
    g_loss, g_entropy = (jnp.where(fresh, g, 0.0) for g in (-g_logp, g_entropy))
    terms = (g_entropy, logsum, entropy)
    coefficient = coefficients(labels, n, options, shift + logsum, g_loss, 0.0, terms)
    backward = backward_split(row, options=options, entropy=True, inplace=True)
    (dlogits,) = backward(logits, labels, shift, logsum, *coefficient)
    return values, dlogits
