"""Cross-entropy with integer labels over the last axis (the vocabulary).

The forward primitive reads the logits once and gives the per-row loss and the row
statistics (shift, logsum), whose sum is the logsumexp, and when asked the gradient of a
weighted sum of the rows' losses, from the rows it holds
(docs/decisions/011-cross-entropy-forward-writes-gradient.md). The backward primitive
reads the logits once more and writes their gradient, from the statistics and per-row
coefficients that fold in the cotangents and the options. The statistics stay apart,
never summed to lse before ``exp(x - shift - logsum)``, so that large logits keep their
precision (docs/decisions/010-cross-entropy-row-statistics.md). No (rows, vocab) float32
intermediate exists on either path. A "sum" or "mean" loss takes the one-pass gradient,
per-row losses (or lse) the two-kernel one. The reductions over rows are plain XLA on
per-row values. With the vocabulary split across devices, each device reduces its slice
and the row statistics are combined with ``pmax`` and ``psum``.

Where a change goes:

- ``options.py``: the public options (``CrossEntropyOptions``) and labels, checked once;
- ``config.py``: the kernels' configurations, filled in from the options;
- ``formulas.py``: the formulas in jnp that the references, the XLA formulation, the
  vocabulary split and linear + cross-entropy share;
- ``forward.py``, ``backward.py``, ``tangent.py``: the three primitives, each with its
  XLA reference, kernel lowering, sharding roles and vocabulary split;
- ``differentiation.py``: the ``custom_jvp``s through which autodiff reaches them;
- ``api.py``: ``cross_entropy`` and ``token_logprobs``;
- ``optax_alias.py``: ``softmax_cross_entropy_with_integer_labels``;
- ``spec.py``: what to build, benchmark and test.
"""

from .api import cross_entropy, token_logprobs
from .optax_alias import softmax_cross_entropy_with_integer_labels

__all__ = ["cross_entropy", "softmax_cross_entropy_with_integer_labels", "token_logprobs"]
