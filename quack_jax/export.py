"""``jax.export`` of functions that use quack_jax.

An exported function carries its kernels: each launch is a custom call whose attributes
hold the cubin, so the serialised artifact runs on a GPU where only JAX and quack_jax are
installed (no CuTe-DSL, no cubin cache). JAX refuses custom calls it does not know in an
export unless told they are stable; :func:`export` says so for quack_jax's one target::

    exported = quack_jax.export.export(jax.jit(f), platforms=("cuda", "cpu"))(x)
    blob = exported.serialize()
    ...  # in another process:
    import quack_jax  # registers the launcher
    y = jax.export.deserialize(blob).call(x)

Lowering for CUDA on a machine without a GPU takes the kernels' arch from
``$QUACK_JAX_CUDA_ARCH`` (``sm_90a``); without it the CUDA lowering uses the XLA
reference.
"""

from __future__ import annotations

import jax

from . import _ffi


def export(fun, *, platforms=None, disabled_checks=(), **kwargs):
    """``jax.export.export(fun, ...)`` with quack_jax's custom call allowed; the other
    arguments are ``jax.export.export``'s."""
    allowed = jax.export.DisabledSafetyCheck.custom_call(_ffi.TARGET)
    return jax.export.export(
        fun, platforms=platforms, disabled_checks=[allowed, *disabled_checks], **kwargs
    )
