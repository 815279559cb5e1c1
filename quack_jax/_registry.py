"""The op families, listed once. Each is a module with a ``SPEC`` (``_spec.OpSpec``):
its public ops, its kernels' configurations, how to build them and its test grid.
``build``, ``bench``, ``benchmarks/prebuild.py`` and the test suites read them from
here; the runtime never imports this module.

Adding an op family: a module (or package) that defines its ops and its ``SPEC``, and its
module path in ``FAMILIES``. docs/guides/adding_an_op.md says more.
"""

from __future__ import annotations

import importlib

from ._spec import OpSpec

FAMILIES = [
    "quack_jax.softmax.spec",
    "quack_jax.norm.spec",
    "quack_jax.cross_entropy.spec",
    "quack_jax.linear_cross_entropy.spec",
]


def families() -> list[OpSpec]:
    """Each family's spec, in ``FAMILIES`` order."""
    return [importlib.import_module(family).SPEC for family in FAMILIES]


def specs() -> dict[str, OpSpec]:
    """Each public op, and its family's spec."""
    return {op: spec for spec in families() for op in spec.ops}


def kernel_configs() -> dict[str, type]:
    """Each kernel op (``KernelConfig.kernels``), and its configuration class."""
    return {op: config for spec in families() for config in spec.configs for op in config.kernels}


def public_ops(kernel_op: str) -> tuple[str, ...]:
    """The public ops of the family that declares the kernel op (``KernelConfig.kernels``):
    building them builds it."""
    for spec in families():
        if any(kernel_op in config.kernels for config in spec.configs):
            return spec.ops
    raise KeyError(f"no op family has a kernel {kernel_op!r}")
