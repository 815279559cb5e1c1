"""Row-wise kernels as JAX primitives, lowered per platform.

Each kernel is a primitive whose operands and results are ``(..., n)`` arrays of one
shape, reduced over the last axis. On a CUDA device whose arch has kernels it lowers to
one launch of a cubin; everywhere else (CPU, TPU, other GPUs, dtypes or sizes the kernels
do not cover) it lowers to an XLA reference with the same semantics. The choice is made
when the computation is lowered for a platform, so one jitted function runs on CPU and
GPU devices in the same process. Batching moves the batch axis into the leading rows.

Differentiation: an op gives its primitive a JVP rule built from kernels, and a linear
primitive a transpose rule, so ``jax.grad`` and ``jax.jvp`` run kernels in both
directions. By default a primitive differentiates its reference, which keeps every
derivative order (``jax.hessian``, forward-over-reverse) available through XLA.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.extend import core
from jax.interpreters import ad, batching, mlir

from . import _ffi
from ._cache import get_kernel
from ._tiling import choose_tiling

# compute capability -> the arch the kernels are compiled for
KERNEL_ARCHS = {"9.0": "sm_90a"}
KERNEL_DTYPES = ("float32", "bfloat16", "float16")
MAX_ROWS = 2**31 - 1


def kernel_arch(ctx: mlir.LoweringRuleContext) -> str | None:
    """The kernel arch of the CUDA devices being lowered for, or None if they have none.

    Lowering for CUDA where no CUDA device is present (``jax.export`` for a GPU from a
    CPU host) uses the arch in ``$QUACK_JAX_CUDA_ARCH`` (``sm_90a``), if set.
    """
    try:
        backend = ctx.module_context.get_backend(optional=True)
    except RuntimeError:
        backend = None
    if backend is None:
        arch = os.environ.get("QUACK_JAX_CUDA_ARCH")
        return arch if arch in KERNEL_ARCHS.values() else None
    capabilities = {getattr(d, "compute_capability", None) for d in backend.local_devices()}
    return KERNEL_ARCHS.get(capabilities.pop()) if len(capabilities) == 1 else None


class RowwisePrimitive:
    """``reference(*operands, **params)`` gives the results; ``kernel_op(**params)`` names
    the kernel of ``family`` (see ``_tiling.choose_tiling``) that computes them."""

    def __init__(
        self,
        name: str,
        *,
        family: str,
        kernel_op: Callable[..., str],
        reference: Callable[..., tuple],
        num_outputs: int = 1,
        jvp: Callable | None = None,
        transpose: Callable | None = None,
    ):
        self.family = family
        self.kernel_op = kernel_op
        self.reference = reference
        self.num_outputs = num_outputs
        p = self.primitive = core.Primitive(name)
        p.multiple_results = True
        p.def_impl(lambda *args, **params: dispatch.apply_primitive(p, *args, **params))
        p.def_abstract_eval(self._abstract_eval)
        batching.primitive_batchers[p] = self._batch
        ad.primitive_jvps[p] = jvp or self._reference_jvp
        if transpose:
            ad.primitive_transposes[p] = transpose
        self._lower_reference = mlir.lower_fun(self._reference_outputs, multiple_results=True)
        mlir.register_lowering(p, self._lower_reference)
        mlir.register_lowering(p, self._lower_cuda, platform="cuda")

    def bind(self, *operands, **params):
        return self.primitive.bind(*operands, **params)

    def _reference_outputs(self, *operands, **params):
        return list(self.reference(*operands, **params))

    def _reference_jvp(self, primals, tangents, **params):
        tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
        return jax.jvp(lambda *a: self._reference_outputs(*a, **params), tuple(primals), tangents)

    def _abstract_eval(self, *avals, **params):
        return [avals[0].update(weak_type=False)] * self.num_outputs

    def _batch(self, operands, dims, **params):
        size = next(x.shape[d] for x, d in zip(operands, dims, strict=True) if d is not None)
        moved = [
            jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
            for x, d in zip(operands, dims, strict=True)
        ]
        return self.bind(*moved, **params), [0] * self.num_outputs

    def _lower_cuda(self, ctx, *operands, **params):
        aval = ctx.avals_in[0]
        n, m = aval.shape[-1], math.prod(aval.shape[:-1])
        dtype = aval.dtype.name
        arch = kernel_arch(ctx)
        tiling = None
        if arch and dtype in KERNEL_DTYPES and n > 0 and 0 < m <= MAX_ROWS:
            tiling = choose_tiling(self.family, n, aval.dtype.itemsize)
        if tiling is None:
            return self._lower_reference(ctx, *operands, **params)
        kernel = get_kernel(self.kernel_op(**params), dtype, tiling, arch)
        return _ffi.launch(
            ctx, operands, kernel, tiling.grid(m), tiling.block, tiling.cluster, (m,)
        )
