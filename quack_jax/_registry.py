"""The op families, listed once. Each is a module of quack_jax with a ``SPEC``
(``_spec.OpSpec``); ``build`` and ``benchmarks/prebuild.py`` read them from here.

Adding an op family: a module that defines its ops and its ``SPEC``, and its name here.
"""

from __future__ import annotations

import importlib

from ._spec import OpSpec

FAMILIES = ("softmax", "norm", "cross_entropy")


def specs() -> dict[str, OpSpec]:
    """Each public op with a kernel build, and its family's spec."""
    out = {}
    for family in FAMILIES:
        spec = importlib.import_module(f"{__package__}.{family}").SPEC
        out |= dict.fromkeys(spec.ops, spec)
    return out
