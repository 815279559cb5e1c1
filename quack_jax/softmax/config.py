"""The softmax kernels' configurations (``_configs.KernelConfig``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .._configs import KernelConfig


@dataclasses.dataclass(frozen=True)
class Softmax(KernelConfig):
    """The forward kernels: y from x."""

    kernel_class = "softmax:SoftmaxForward"
    kernels: ClassVar[dict] = {"softmax_fwd": {"log": False}, "log_softmax_fwd": {"log": True}}
    log: bool = False


@dataclasses.dataclass(frozen=True)
class SoftmaxDerivative(KernelConfig):
    """The derivative kernels, linear in t: ``kind`` is "softmax" (reads y), "log_vjp" or
    "log_jvp" (read x)."""

    kernel_class = "softmax:SoftmaxDerivative"
    kernels: ClassVar[dict] = {
        "softmax_bwd": {"kind": "softmax"},
        "log_softmax_bwd": {"kind": "log_vjp"},
        "log_softmax_jvp": {"kind": "log_jvp"},
    }
    kind: str = "softmax"
