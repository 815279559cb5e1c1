"""The choice of implementation of every public op: its ``implementation`` argument.

``None`` (the default) runs the kernels where they run (a CUDA sm_90 device; at small
shapes XLA's formulation there, by each family's rules, see
``_primitive.REFERENCE_FASTER``) and the XLA fallback elsewhere, both through quack_jax's
primitives. ``"xla"`` runs a pure XLA formulation of the op, differentiated
by JAX itself, with no quack_jax primitive in the program: a way to bisect a numerics
difference. Where ``implementation`` is None, the
environment variable ``QUACK_JAX_IMPLEMENTATION=xla`` chooses XLA for the whole program;
it is read when a function is traced, so it must be set before the program traces (jit
caches traces).
"""

from __future__ import annotations

import os

ENV = "QUACK_JAX_IMPLEMENTATION"


def use_xla(fn: str, implementation) -> bool:
    """Whether ``fn`` runs its pure XLA formulation, validating ``implementation``."""
    if isinstance(implementation, str) and implementation == "xla":
        return True
    if implementation is not None:
        raise ValueError(f"{fn}: implementation must be None or 'xla', got {implementation!r}")
    env = os.environ.get(ENV) or None
    if env not in (None, "xla"):
        raise ValueError(f"{fn}: ${ENV} must be unset, empty or 'xla', got {env!r}")
    return env == "xla"
