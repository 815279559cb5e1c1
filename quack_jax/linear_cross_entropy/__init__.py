"""Linear + cross-entropy without the logits: ``cross_entropy(h @ W + bias, labels)`` in
chunks of rows, or over slices of the vocabulary.

The (tokens, vocabulary) logits never exist whole. For each chunk of rows XLA's GEMM
makes the chunk's logits, and the cross-entropy kernel that writes the gradient writes it
over them (an aliased output, so the chunk has one (rows, V) buffer); two more GEMMs give
the chunk's rows of dh and add its share of dW (and of the bias gradient) to float32
accumulators. Why chunks of this size, equal and overlapping, with a float32 dW:
docs/decisions/017-linear-cross-entropy-chunks.md. Per-row losses, whose cotangents come
in the backward pass, go over slices of the vocabulary instead, half of which keep their
logits for the backward, and write each slice's dW in the weight's dtype:
docs/decisions/028-per-row-losses-over-vocabulary-slices.md.

Where a change goes:

- ``options.py``: the linear map's options (``LinearOptions``: layout, chunk size,
  precision, logits' dtype, the vocabulary slices), checked once with h, the weight and
  the bias; the cross-entropy's options are ``cross_entropy.options.CrossEntropyOptions``;
- ``chunks.py``: the chunked loop on one device's rows;
- ``slices.py``: the per-row path's loop over one device's vocabulary slices;
- ``partition.py``: how XLA partitions it under a sharded ``jit``;
- ``primitive.py``: the primitive, its shapes, batching and lowering;
- ``differentiation.py``: the ``custom_vjp``s through which autodiff reaches it;
- ``api.py``: ``linear_cross_entropy``, ``linear_token_logprobs`` and
  ``linear_token_loss``;
- ``spec.py``: what to build and test.
"""

from .api import linear_cross_entropy, linear_token_logprobs, linear_token_loss

__all__ = ["linear_cross_entropy", "linear_token_logprobs", "linear_token_loss"]
