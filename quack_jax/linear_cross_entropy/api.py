"""``linear_cross_entropy``, ``linear_token_logprobs`` and ``linear_token_loss``: the
options checked once, then the chunked loop's derivatives (``differentiation.py``) or,
with ``implementation="xla"``, the whole logits and the cross-entropy's XLA
formulation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._implementation import use_xla
from .._primitive import compute_dtype
from ..cross_entropy.formulas import (
    entropy_of,
    finish,
    logprob_outputs,
    rows,
    tempered,
    xla_formulation,
)
from ..cross_entropy.options import (
    CrossEntropyOptions,
    checked_reduction,
    labels_of,
    logprob_options,
)
from .chunks import TokenLoss
from .differentiation import Call, per_row, reduced, token_loss
from .options import LinearOptions


def linear_cross_entropy(
    h: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    transpose_weight: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcap: float | None = None,
    temperature: float = 1.0,
    return_lse: bool = False,
    chunk_size: int | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    implementation: str | None = None,
):
    """``cross_entropy(h @ weight + bias, labels, ...)`` without making the logits.

    A "sum" or "mean" loss goes over the rows of ``h`` in chunks of at most
    ``chunk_size``: each chunk's logits are made by XLA's GEMM, the cross-entropy kernel
    writes their gradient over them in place, and the gradients are made in the forward
    pass, the weight's summed over the chunks in float32. Per-row losses (and lse),
    whose cotangents come only in the backward pass, go over as many slices of the
    vocabulary instead, rounded up to a power of two (or in chunks of rows where the
    rows outnumber the vocabulary): the forward pass combines the slices' row statistics
    and keeps the logits of the last half of the slices (of the one, where one slice
    holds the vocabulary), within 1/4 of the free device memory; the backward writes
    their gradient over them in place, makes the other slices' logits again, sums dh
    over the slices in float32, and each slice's weight gradient GEMM writes the
    weight's dtype. Results and gradients are those of
    ``cross_entropy`` of the full logits.
    A vocabulary that is not a multiple of 8 is padded with zeros to a multiple of 64 for
    the GEMMs (a padded copy of the weight), whose misaligned rows would run about three
    times slower; the loss never sees the padding.

    Args:
      h: array (..., d), float32, bfloat16 or float16 (float64 runs the XLA reference).
      weight: the LM head, (d, V) as a Flax ``Dense`` kernel, or (V, d) with
        ``transpose_weight`` (a tied embedding table, used without a transposed copy);
        h's dtype.
      labels: integer array of shape ``h.shape[:-1]``.
      bias: None, or (V,) of the weight's dtype, added to the logits.
      transpose_weight: whether ``weight`` is (V, d).
      ignore_index, reduction, label_smoothing, z_loss: as in
        :func:`quack_jax.cross_entropy`.
      logit_softcap, temperature, return_lse: as in :func:`quack_jax.cross_entropy`.
      chunk_size: the most rows per chunk, a positive int; by default (None) the rows
        whose logits take at most 1 GiB (or 2048 rows where that is more), and at
        most 1/8 of the free device memory (see ``default_chunk``). The rows go in
        ceil(T / chunk_size) chunks of equal size; where that size does not divide T,
        the last chunk ends at row T and overlaps the one before it (its rows done
        before get no second gradient). Per-row losses go over as many vocabulary
        slices instead, rounded up to a power of two, each no larger than a chunk.
      precision: of the three GEMMs, as in ``jax.lax.dot_general``.
      preferred_element_type: the logits' dtype (default: h's). The backward GEMMs take
        dlogits in h's dtype.
      implementation: None, or "xla": the whole logits ``h @ weight + bias`` made by
        XLA and :func:`quack_jax.cross_entropy`'s XLA formulation on them, differentiated
        by JAX (no chunks, no quack_jax primitive: to bisect a numerics difference). None
        follows ``$QUACK_JAX_IMPLEMENTATION``, read at trace time.

    Returns:
      the loss in float32 (float64 for float64 logits): a scalar for "sum" and "mean",
      of ``labels``' shape for "none"; with ``return_lse`` the tuple ``(loss, lse)``.
    """
    fn = "linear_cross_entropy"
    h, weight, bias, linear = LinearOptions.of(
        fn,
        h,
        weight,
        bias,
        transpose_weight=transpose_weight,
        chunk_size=chunk_size,
        precision=precision,
        preferred=preferred_element_type,
    )
    labels = labels_of(fn, labels, h.shape[:-1])
    options = CrossEntropyOptions.of(
        fn,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        logit_softcap=logit_softcap,
        temperature=temperature,
    )
    checked_reduction(fn, reduction, return_lse)
    if use_xla(fn, implementation):
        logits = _logits(h, weight, bias, linear)
        return xla_formulation(logits, labels, options, reduction, return_lse)
    bias_dtype = None if bias is None else bias.dtype.name
    call = Call(options, linear, reduction, weight.dtype.name, bias_dtype)
    if reduction != "none" and not return_lse:
        return reduced(call, h, weight, bias, labels)
    loss, lse = per_row(call, h, weight, bias, labels)
    return finish(loss, lse, labels, options, reduction, return_lse)


def linear_token_logprobs(
    h: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    transpose_weight: bool = False,
    temperature: float = 1.0,
    return_entropy: bool = False,
    logit_softcap: float | None = None,
    ignore_index: int | None = None,
    chunk_size: int | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    implementation: str | None = None,
):
    """``token_logprobs(h @ weight + bias, labels, ...)`` without making the logits: the
    log-probability of each row's label at ``temperature``, and with ``return_entropy``
    the entropy, by :func:`linear_cross_entropy`'s per-row path (over vocabulary slices,
    half of which keep their logits from the forward pass; under ``jax.grad`` the
    backward makes the others' again, and runs the backward kernel over each slice's
    logits for the cotangents of both outputs).

    Args:
      h, weight, labels, bias, transpose_weight: as in :func:`linear_cross_entropy`.
      chunk_size, precision, preferred_element_type: as in :func:`linear_cross_entropy`.
      temperature, return_entropy, logit_softcap, ignore_index: as in
        :func:`quack_jax.token_logprobs`.
      implementation: None, or "xla": the whole logits made by XLA and
        :func:`quack_jax.token_logprobs`' XLA formulation on them.

    Returns:
      logp, float32 of ``labels``' shape, and with ``return_entropy`` the tuple
      ``(logp, entropy)``.
    """
    fn = "linear_token_logprobs"
    h, weight, bias, labels, linear, options = _logprob_arguments(
        fn,
        h,
        weight,
        bias,
        labels,
        transpose_weight=transpose_weight,
        temperature=temperature,
        return_entropy=return_entropy,
        logit_softcap=logit_softcap,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    if use_xla(fn, implementation):
        loss, ent = _xla_logprobs(h, weight, bias, labels, linear, options, return_entropy)
    else:
        bias_dtype = None if bias is None else bias.dtype.name
        call = Call(options, linear, "none", weight.dtype.name, bias_dtype, return_entropy)
        loss, _, *ent = per_row(call, h, weight, bias, labels)
    return logprob_outputs(loss, ent, labels, options)


def linear_token_loss(
    h: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    loss_fn: Callable[..., jax.Array],
    *args: jax.Array,
    bias: jax.Array | None = None,
    transpose_weight: bool = False,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
    ignore_index: int | None = None,
    chunk_size: int | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    implementation: str | None = None,
):
    """The sum over the tokens of ``loss_fn(logp, entropy, *args)``: a loss of each
    token's log-probability and entropy (:func:`linear_token_logprobs` with
    ``return_entropy``), without making the logits, and with its gradients made in the
    forward pass.

    That is

    .. code-block:: python

        logp, entropy = linear_token_logprobs(h, weight, labels, return_entropy=True)
        jnp.sum(jax.vmap(loss_fn)(logp, entropy, *args))

    but in three GEMMs per chunk: ``jax.grad`` of that composition knows the tokens'
    cotangents only in the backward pass, which makes again the logits of the
    vocabulary slices not kept from the forward pass (where there is more than one
    slice). Here each chunk of rows runs the forward kernel,
    ``loss_fn``'s derivatives by ``jax.vjp``, then the backward kernel over the same
    logits, and its GEMMs for dh and dW. A policy-gradient loss (GRPO, PPO) with an
    entropy bonus is such a loss.

    ``loss_fn`` takes one token's values, float scalars, and returns a float scalar; it
    is mapped over the tokens by ``jax.vmap``, so that each token's value depends on that
    token alone. A mean goes in as a per-token weight, for example ``mask / mask.sum()``
    as an argument.

    Args:
      h, weight, labels, bias, transpose_weight: as in :func:`linear_cross_entropy`.
      loss_fn: ``(logp, entropy, *args) -> loss`` of one token.
      *args: arrays of ``labels``' shape, one value per token (advantages, old
        log-probabilities, weights, masks); the floating ones are differentiated.
      temperature, logit_softcap, ignore_index: as in :func:`quack_jax.token_logprobs`;
        an ignored token has logp and entropy 0, and ``loss_fn`` still sees it.
      chunk_size, precision, preferred_element_type: as in
        :func:`linear_cross_entropy`.
      implementation: None, or "xla": the whole logits made by XLA,
        :func:`quack_jax.token_logprobs`' XLA formulation on them and ``loss_fn``,
        differentiated by JAX.

    Returns:
      the loss, a float32 scalar (float64 for float64 logits).
    """
    fn = "linear_token_loss"
    h, weight, bias, labels, linear, options = _logprob_arguments(
        fn,
        h,
        weight,
        bias,
        labels,
        transpose_weight=transpose_weight,
        temperature=temperature,
        return_entropy=True,
        logit_softcap=logit_softcap,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    args = _token_arguments(fn, args, labels.shape)
    loss = TokenLoss(_checked_loss_fn(fn, loss_fn, args, linear))
    if use_xla(fn, implementation):
        rows_loss, ent = _xla_logprobs(h, weight, bias, labels, linear, options, True)
        logp, entropy = logprob_outputs(rows_loss, ent, labels, options)
        flat = [a.reshape(-1) for a in (logp, entropy, *args)]
        return jnp.sum(loss.values(flat[0], flat[1], flat[2:]))
    bias_dtype = None if bias is None else bias.dtype.name
    dtypes = tuple(a.dtype.name for a in args)
    call = Call(options, linear, "none", weight.dtype.name, bias_dtype, True, loss, dtypes)
    return token_loss(call, h, weight, bias, labels, *args)


def _logprob_arguments(
    fn,
    h,
    weight,
    bias,
    labels,
    *,
    transpose_weight,
    temperature,
    return_entropy,
    logit_softcap,
    ignore_index,
    chunk_size,
    precision,
    preferred_element_type,
):
    """h, the weight, the bias, the labels, the linear options and the token_logprobs
    options, checked."""
    h, weight, bias, linear = LinearOptions.of(
        fn,
        h,
        weight,
        bias,
        transpose_weight=transpose_weight,
        chunk_size=chunk_size,
        precision=precision,
        preferred=preferred_element_type,
    )
    shape = (*h.shape[:-1], linear.vocab(weight))
    labels, options = logprob_options(
        fn,
        shape,
        labels,
        temperature=temperature,
        return_entropy=return_entropy,
        logit_softcap=logit_softcap,
        ignore_index=ignore_index,
    )
    return h, weight, bias, labels, linear, options


def _xla_logprobs(h, weight, bias, labels, linear, options, entropy):
    """The rows' loss (-logp) and, with ``entropy``, [entropy], of the whole logits
    made by XLA (``implementation="xla"``)."""
    logits = _logits(h, weight, bias, linear)
    loss, shift, logsum = rows(logits, labels, options)
    z, _ = tempered(logits, options)
    return loss, [entropy_of(z, shift, logsum)] if entropy else []


def _token_arguments(fn, args, shape):
    """The per-token arguments as arrays of ``shape`` (the labels')."""
    out = []
    for i, a in enumerate(args):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(
                f"{fn}: args[{i}] must be an array of labels' shape {shape}, got {type(a).__name__}"
            )
        if tuple(a.shape) != tuple(shape):
            raise ValueError(
                f"{fn}: args[{i}] must have labels' shape {shape} (one value per token), "
                f"got {tuple(a.shape)}"
            )
        out.append(jnp.asarray(a))
    return out


def _checked_loss_fn(fn, loss_fn, args, linear):
    """``loss_fn``, once it is seen to map one token's scalars to a float scalar."""
    if not callable(loss_fn):
        raise TypeError(f"{fn}: loss_fn must be callable, got {type(loss_fn).__name__}")
    stat = jax.ShapeDtypeStruct((), compute_dtype(linear.preferred_element_type))
    scalars = [jax.ShapeDtypeStruct((), a.dtype) for a in args]
    try:
        out = jax.eval_shape(loss_fn, stat, stat, *scalars)
    except Exception as error:
        raise TypeError(
            f"{fn}: loss_fn(logp, entropy, *args) failed on one token's scalars, with "
            f"{len(args)} per-token argument(s): {type(error).__name__}: {error}"
        ) from error
    if not (hasattr(out, "shape") and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)):
        got = f"shape {out.shape}, {out.dtype}" if hasattr(out, "shape") else type(out).__name__
        raise TypeError(
            f"{fn}: loss_fn(logp, entropy, *args) must return a float scalar for one "
            f"token, got {got}"
        )
    return loss_fn


def _logits(h, weight, bias, linear):
    """The whole logits ``h @ weight + bias``, made by XLA (``implementation="xla"``)."""
    d, vocab = h.shape[-1], linear.vocab(weight)
    return linear.logits(h.reshape(-1, d), weight, bias).reshape(*h.shape[:-1], vocab)
