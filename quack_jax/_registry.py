"""The op families, listed once. Each is a module with a ``SPEC`` (``_spec.OpSpec``):
its public ops, its kernels' configurations, how to build them and its test grid.
``build``, ``bench``, the cache's error message, ``benchmarks/prebuild.py`` and the test
suites read them from here.

Adding an op family: a module (or package) that defines its ops and its ``SPEC``, and its
module path in ``FAMILIES``. docs/guides/adding_an_op.md says more.
"""

from __future__ import annotations

import importlib

from ._spec import OpSpec

FAMILIES = [
    "quack_jax.softmax",
    "quack_jax.norm.spec",
    "quack_jax.cross_entropy",
    "quack_jax.linear_cross_entropy",
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
    """The public ops whose build may make the kernel op: the one it is named after
    (``rms_norm`` for ``rms_norm_fwd``) and the family's ops that no kernel is named
    after (``token_logprobs`` runs cross_entropy's kernels), else every op of its family."""
    for spec in families():
        kernels = [k for config in spec.configs for k in config.kernels]
        if kernel_op in kernels:
            named = [op for op in spec.ops if any(k.startswith(op + "_") for k in kernels)]
            ops = [op for op in spec.ops if kernel_op.startswith(op + "_") or op not in named]
            return tuple(ops) or spec.ops
    raise KeyError(f"no op family has a kernel {kernel_op!r}")
