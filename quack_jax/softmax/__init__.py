"""Softmax and log-softmax with fused forward and derivative kernels.

The forward primitive computes y from x. The derivative primitive is linear in its first
operand t and reads one saved operand s. Softmax's reads its output (s = y):
``y * (t - sum(t * y))``, which is its own transpose. Log-softmax's recompute p =
softmax(x) from x (s = x), since a 16-bit log-probability gives p only to
``|log p| * 2^-8`` relative: the forward-mode form ``t - sum(p * t)`` and its transpose
``t - p * sum(t)`` (docs/decisions/012-softmax-derivative-from-saved-y.md). ``jax.grad``
therefore runs the forward kernel and one derivative kernel that reads s and the
cotangent and writes the gradient (log-softmax's forward kernel only where its output is
used); ``jax.jvp`` likewise. At small shapes the default lowering takes XLA's formulation
of the forward, and of softmax's derivative over short rows, where that measured faster
(docs/decisions/004-small-shape-xla-rules.md and 005-softmax-derivative-on-xla.md). With
the softmax axis split across devices (under a sharded ``jit``), each device runs the XLA
reference on its slice of the rows, with the rows' max and sums combined by
``pmax``/``psum``.

Where a change goes:

- ``config.py``: the kernels' configurations;
- ``reference.py``: XLA's formulations of the forward and the derivative;
- ``forward.py``, ``derivative.py``: the two primitives, each with its kernel lowering,
  and the forward's JVP, the derivative's transpose;
- ``rules.py``: where the default lowering takes XLA's formulation;
- ``api.py``: ``softmax``, ``log_softmax``, their axes and mask;
- ``spec.py``: what to build, benchmark and test.
"""

from .api import log_softmax, softmax

__all__ = ["log_softmax", "softmax"]
