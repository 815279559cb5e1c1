"""``cross_entropy`` and ``token_logprobs``: the options checked once, then the kernels'
derivatives (``differentiation.py``) or the plain-XLA formulation."""

from __future__ import annotations

import jax

from .._checks import float_array
from .._implementation import use_xla
from .differentiation import per_row, reduced
from .formulas import entropy_of, finish, logprob_outputs, rows, tempered, xla_formulation
from .options import CrossEntropyOptions, checked_reduction, labels_of, logprob_options


def cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcap: float | None = None,
    temperature: float = 1.0,
    return_lse: bool = False,
    implementation: str | None = None,
):
    """Softmax cross-entropy with integer labels over the last axis of ``logits``.

    With ``x = logit_softcap * tanh(logits / logit_softcap) / temperature`` (or the
    logits, over the temperature) and ``lse = logsumexp(x)``, the loss of a row is
    ``lse - (1 - label_smoothing) * x[label] - label_smoothing * mean(x) + z_loss * lse**2``
    (PyTorch's label smoothing; PaLM's z-loss; Gemma 2's softcap).

    Args:
      logits: array (..., V), float32, bfloat16 or float16 (float64 runs the XLA
        reference). Math is in float32.
      labels: integer array of shape ``logits.shape[:-1]``.
      ignore_index: rows with this label have loss 0 and gradient 0 and do not count
        towards "mean".
      reduction: "none" (per-row losses, the leading shape), "sum", or "mean" (the sum
        divided by the number of rows not ignored: NaN when all are ignored, as in
        PyTorch).
      label_smoothing: in [0, 1).
      z_loss: coefficient of ``lse**2``, >= 0.
      logit_softcap: None, or a positive cap applied to the logits first.
      temperature: positive; the (softcapped) logits are divided by it (a sampling
        temperature; the kernels scale their exponent, at no cost).
      return_lse: also return the per-row lse (of every row, ignored ones too).
      implementation: None (the kernels on a CUDA sm_90 device, the XLA fallback
        elsewhere) or "xla": a plain jnp formulation that JAX differentiates, with no
        quack_jax primitive in the program (to bisect a numerics difference). None
        follows ``$QUACK_JAX_IMPLEMENTATION`` (``xla`` or unset), read at trace time.

    Returns:
      the loss in float32 (float64 for float64 logits), and with ``return_lse`` the
      tuple ``(loss, lse)``.

    A label outside [0, V) other than ``ignore_index`` gives a NaN loss (and NaN
    gradient) for its row; it is never read out of bounds. NaN logits give a NaN loss
    for their row; a row with +inf logits has lse +inf. The softmax is
    ``exp(x - max - log(sum(exp(x - max))))``, never ``exp(x - lse)``, so large logits
    keep their precision. ``jax.grad`` of a sum or mean takes the gradient that the
    forward kernel writes; of per-row losses or lse, one backward kernel that reads the
    logits and writes their gradient in their dtype. ``jax.jvp`` and ``jax.jacfwd`` run the
    forward kernel and an XLA reduction of the tangent.
    """
    fn = "cross_entropy"
    logits = float_array(fn, "logits", logits)
    labels = labels_of(fn, labels, logits.shape[:-1])
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
        return xla_formulation(logits, labels, options, reduction, return_lse)
    if reduction != "none" and not return_lse:
        return reduced(logits, labels, options, reduction == "mean")
    loss, lse = per_row(logits, labels, options, False)
    return finish(loss, lse, labels, options, reduction, return_lse)


def token_logprobs(
    logits: jax.Array,
    labels: jax.Array,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    logit_softcap: float | None = None,
    ignore_index: int | None = None,
    implementation: str | None = None,
):
    """The log-probability of each row's label under ``softmax(z)``, and with
    ``return_entropy`` the softmax's entropy, over the last axis: what RL fine-tuning
    (PPO, GRPO) and distillation read from the vocabulary.

    With ``z = logit_softcap * tanh(logits / logit_softcap) / temperature`` (or the
    logits over the temperature), ``logp = z[label] - logsumexp(z)`` and
    ``entropy = logsumexp(z) - sum(softmax(z) * z)``, both from one read of the logits,
    in float32. ``jax.grad`` of any function of them runs one backward kernel (one read of
    the logits, one write of their gradient) for the cotangents of both:
    ``d logp / d logits = (onehot - p) / T`` and ``d entropy / d logits =
    -p * (z - E_p[z]) / T`` (times the softcap's derivative).

    Args:
      logits: array (..., V), float32, bfloat16 or float16 (float64 runs the XLA
        reference).
      labels: integer array of shape ``logits.shape[:-1]``: the sampled tokens.
      temperature: positive: the sampling temperature.
      return_entropy: also return the entropy of each row.
      logit_softcap: None, or a positive cap applied to the logits first.
      ignore_index: None (every row counts), or the label of rows to ignore (padding):
        their logp and entropy are 0, and so are their gradients.
      implementation: as in :func:`cross_entropy`.

    Returns:
      logp, float32 of the leading shape (float64 for float64 logits), and with
      ``return_entropy`` the tuple ``(logp, entropy)``.

    A label outside [0, V) (and not ``ignore_index``) gives a NaN logp for its row (its
    entropy is still the row's). Logits of -inf (masked vocabulary entries) have p = 0
    and add 0 to the entropy; a row of only -inf logits gives NaN.
    """
    fn = "token_logprobs"
    logits = float_array(fn, "logits", logits)
    labels, options = logprob_options(
        fn,
        logits.shape,
        labels,
        temperature=temperature,
        return_entropy=return_entropy,
        logit_softcap=logit_softcap,
        ignore_index=ignore_index,
    )
    if use_xla(fn, implementation):
        loss, shift, logsum = rows(logits, labels, options)
        z, _ = tempered(logits, options)
        h = [entropy_of(z, shift, logsum)] if return_entropy else []
    else:
        loss, _, *h = per_row(logits, labels, options, return_entropy)
    return logprob_outputs(loss, h, labels, options)
