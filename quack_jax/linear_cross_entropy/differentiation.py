"""How ``jax.grad`` reaches the chunked loop: ``custom_vjp``s that make only the
gradients autodiff asks for (``symbolic_zeros``). A "sum" or "mean" loss alone has its
gradients at the end of the forward pass, which the cotangent scales; per-row losses (or
lse) keep the row statistics, and the backward runs the backward kernel in place over
each vocabulary slice's logits, kept from the forward pass or made again
(docs/decisions/028-per-row-losses-over-vocabulary-slices.md), or over each chunk of
rows' logits made again. A token loss, a sum of per-token values, has its gradients at
the end of the forward pass too."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ..cross_entropy.formulas import coefficients, reduce, row_weights
from ..cross_entropy.options import CrossEntropyOptions
from .chunks import Needs, TokenLoss
from .options import LinearOptions
from .primitive import bind


@dataclasses.dataclass(frozen=True)
class Call:
    """The static arguments of a call: the cross-entropy options, the linear map, the
    reduction, the dtypes the gradients are returned in, whether the rows' entropy is
    made (linear_token_logprobs), and the token loss and its arguments' dtypes
    (linear_token_loss)."""

    options: CrossEntropyOptions
    linear: LinearOptions
    reduction: str
    weight_dtype: str
    bias_dtype: str | None
    entropy: bool = False
    token_loss: TokenLoss | None = None
    arg_dtypes: tuple[str, ...] = ()

    def bind(self, mode, needs, h, w, bias, labels, *per_row, slices=None, kept=()):
        entropy = self.entropy and mode != "grad"
        return bind(
            mode,
            needs,
            h,
            w,
            bias,
            labels,
            *per_row,
            linear=self.linear,
            options=self.options,
            entropy=entropy,
            token_loss=self.token_loss,
            slices=slices,
            kept=kept,
        )

    def gradients(self, needs, grads, scale=None):
        """The cotangents of (h, weight, bias, labels, *args) from the gradients ``needs``
        made, times ``scale``, in their arguments' dtypes."""
        grads = iter(grads)
        out = []
        dtypes = (None, self.weight_dtype, self.bias_dtype)
        flags = (needs.h, needs.weight, needs.bias)
        for on, dtype in zip(flags, dtypes, strict=True):
            out.append(_scaled(next(grads), scale, dtype) if on else None)
        pairs = zip(self.arg_dtypes, needs.args, strict=True)
        args = [_scaled(next(grads), scale, dtype) if on else None for dtype, on in pairs]
        return (*out, None, *args)


def _scaled(g, scale, dtype):
    dtype = dtype or g.dtype
    return (g if scale is None else g * scale).astype(dtype)


NOTHING = Needs(False, False, False)


def _needs(h, w, bias) -> Needs:
    return Needs(h.perturbed, w.perturbed, bias is not None and bias.perturbed)


def _values(*primals):
    return [None if p is None else p.value for p in primals]


# "sum" or "mean" alone: the gradients come from the forward pass


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def reduced(call: Call, h, w, bias, labels):
    loss, *_ = call.bind("loss", NOTHING, h, w, bias, labels)
    return reduce(loss, labels, call.options.ignore_index, call.reduction == "mean")


def _reduced_forward(call: Call, h, w, bias, labels):
    needs = _needs(h, w, bias)
    h, w, bias, labels = _values(h, w, bias, labels)
    ignore_index, mean = call.options.ignore_index, call.reduction == "mean"
    weights = row_weights(labels, ignore_index, mean)
    loss, _, _, *grads = call.bind("grad", needs, h, w, bias, labels, weights)
    return reduce(loss, labels, ignore_index, mean), (needs, grads)


def _reduced_backward(call: Call, saved, g):
    needs, grads = saved
    return call.gradients(needs, grads, g)


reduced.defvjp(_reduced_forward, _reduced_backward, symbolic_zeros=True)


# per-row losses (or lse): over vocabulary slices, some of which keep their logits from
# the forward pass, or in chunks of rows whose logits the backward makes again


def _slices(call: Call, w, labels, keep):
    return call.linear.slices(labels.size, call.linear.vocab(w), keep)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def per_row(call: Call, h, w, bias, labels):
    """The rows' loss and lse, and with ``call.entropy`` their entropy."""
    slices = _slices(call, w, labels, keep=False)
    loss, shift, logsum, *ent = call.bind("loss", NOTHING, h, w, bias, labels, slices=slices)
    return (loss, shift + logsum, *ent)


def _per_row_forward(call: Call, h, w, bias, labels):
    needs = _needs(h, w, bias)
    h, w, bias, labels = _values(h, w, bias, labels)
    slices = _slices(call, w, labels, keep=needs != NOTHING)
    loss, shift, logsum, *rest = call.bind("loss", needs, h, w, bias, labels, slices=slices)
    ent, kept = rest[: call.entropy], rest[call.entropy :]
    saved = (needs, h, w, bias, labels, shift, logsum, ent, slices, kept)
    return (loss, shift + logsum, *ent), saved


def _dense(cotangent, like):
    if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
        return jnp.zeros(like.shape, like.dtype)
    return cotangent


def _per_row_backward(call: Call, saved, cotangents):
    needs, h, w, bias, labels, shift, logsum, ent, slices, kept = saved
    lse = shift + logsum
    g_loss, g_lse, *g_ent = (_dense(c, lse) for c in cotangents)
    terms = (g_ent[0], logsum, ent[0]) if call.entropy else None
    vocab = call.linear.vocab(w)
    coefficient = coefficients(labels, vocab, call.options, lse, g_loss, g_lse, terms)
    per_row = (shift, logsum, *coefficient)
    grads = call.bind("backward", needs, h, w, bias, labels, *per_row, slices=slices, kept=kept)
    return call.gradients(needs, grads)


per_row.defvjp(_per_row_forward, _per_row_backward, symbolic_zeros=True)


# a token loss: the sum of the rows' values, whose gradients come from the forward pass


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def token_loss(call: Call, h, w, bias, labels, *args):
    nothing = dataclasses.replace(NOTHING, args=(False,) * len(args))
    value, *_ = call.bind("token_loss", nothing, h, w, bias, labels, *args)
    return jnp.sum(value)


def _token_loss_forward(call: Call, h, w, bias, labels, *args):
    perturbed = tuple(a.perturbed for a in args)
    needs = dataclasses.replace(_needs(h, w, bias), args=perturbed)
    h, w, bias, labels, *args = _values(h, w, bias, labels, *args)
    value, *grads = call.bind("token_loss", needs, h, w, bias, labels, *args)
    return jnp.sum(value), (needs, grads)


def _token_loss_backward(call: Call, saved, g):
    needs, grads = saved
    return call.gradients(needs, grads, g)


token_loss.defvjp(_token_loss_forward, _token_loss_backward, symbolic_zeros=True)
