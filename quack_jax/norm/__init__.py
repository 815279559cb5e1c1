"""RMSNorm and LayerNorm over the last axis, with a fused residual add.

The forward primitive computes y, h = x + residual (when there is one) and the per-row
statistics the backward needs (rstd, and mean for LayerNorm) in one pass. The backward
primitive computes dx from dy, h and the statistics, plus the weight and bias gradients
from per-CTA float32 partials, never atomics
(docs/decisions/015-weight-gradients-from-partials.md): of a persistent grid, summed by
XLA, or over few row blocks of one cluster, whose kernel sums them itself
(docs/decisions/016-norm-backward-summing-cluster.md); no normalised copy of x is ever
stored. The tangent primitive, linear in the tangents of x, the residual, weight and
bias, is the forward-mode derivative (XLA everywhere); its transpose binds the backward,
so ``jax.jvp`` runs the forward kernel and ``jax.grad`` the forward and backward kernels
(at small shapes XLA's formulation: ``rules.py``). With the normalised axis split across
devices (under a sharded ``jit``), each device runs the XLA reference on its slice of the
rows, with the rows' means ``psum``'d.

Where a change goes:

- ``options.py``: the public options (``NormOptions``), checked once;
- ``config.py``: the kernels' configurations;
- ``operands.py``: the optional operands and the batching helpers the primitives share;
- ``forward.py``, ``backward.py``, ``tangent.py``: the three primitives, each with its
  XLA reference, kernel lowering, batching and sharding roles;
- ``rules.py``: where the default lowering takes XLA's formulation;
- ``api.py``: ``rms_norm``, ``layer_norm`` and their differentiation;
- ``spec.py``: what to build, benchmark and test.
"""

from .api import layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm"]
