"""A toy op family, l2_norm, declared as a new op would be: this folder (its op, its kernel
configuration, its spec, and its kernel in ``kernel.py``) and one line in
``quack_jax._registry.FAMILIES``. ``tests/test_registry.py`` adds that line and checks that
build, bench, the cache's error message and the test grid pick the op up, and the kernel
runs on a GPU.

    l2_norm(x) = x / sqrt(sum(x^2) + eps) over the last axis
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from quack_jax._configs import KernelConfig, scalar
from quack_jax._primitive import RowwisePrimitive, compute_dtype, kernel_call, row_tiling
from quack_jax._spec import FWD_COLUMNS, Benchmark, Case, OpSpec, Shapes
from quack_jax._tiling import K, TilingFamily

# its own launch shapes: 32 threads a row, 128 a CTA, up to 64K elements a row (longer
# rows spread over more threads and CTAs until they fit; see ``choose_tiling``)
TILINGS = TilingFamily("l2_norm", {2: [(64 * K, (32, 128, 1))], 4: [(64 * K, (32, 128, 1))]})
# its own rule: a single row of up to 256 elements runs on XLA (a kernel launch costs more)
SMALL = 256


def on_xla(m, n, itemsize, *, eps):
    return m == 1 and n <= SMALL


@dataclasses.dataclass(frozen=True)
class L2NormConfig(KernelConfig):
    kernel_class = "l2_norm.kernel:L2Norm"
    kernels: ClassVar[dict] = {"l2_norm_fwd": {}}
    eps: float = scalar(0.0)


def _reference(x, *, eps):
    x32 = x.astype(compute_dtype(x.dtype))
    return (
        (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype),
    )


def _kernel(target, avals_in, avals_out, *, eps):
    tiling = row_tiling(avals_in[0], TILINGS)
    config = L2NormConfig(eps=eps)
    return tiling and kernel_call(target, config, avals_in[0], tiling, avals_out)


_forward = RowwisePrimitive(
    "toy_l2_norm", kernel=_kernel, reference=_reference, prefers_reference=on_xla
)


def l2_norm(x, eps: float = 1e-6):
    return _forward.bind(x, eps=float(eps))[0]


def _lowerings(op, dtype, n, packaged):
    yield l2_norm, (jax.ShapeDtypeStruct((8, n), dtype),)


def _benchmarks():
    def xla(x):
        return _reference(x, eps=1e-6)[0]

    return [
        Benchmark(
            "l2_norm",
            shapes=[(16384, 4096)],
            quick_shapes=[(64, 1000)],
            arguments=lambda m, n, dtype: [((m, n), dtype)] * 2,
            cases=[
                Case("quack_fwd", "quack_jax fwd", 2, l2_norm, -1, kernel=True),
                Case("xla_fwd", "XLA fwd", 2, xla, -1),
            ],
            tuned=[],
            columns=FWD_COLUMNS,
            footprint=4,
        )
    ]


SPEC = OpSpec(
    ops=("l2_norm",),
    configs=(L2NormConfig,),
    sizes="hidden",
    lowerings=_lowerings,
    tests={
        "cpu": Shapes(rows=(1, 5), sizes=(7, 1000)),
        "gpu": Shapes(rows=(1, 5, 3000), sizes=(7, 1000, 65536)),
    },
    benchmarks=_benchmarks,
)
