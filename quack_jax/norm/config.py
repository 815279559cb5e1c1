"""The norm kernels' configurations (``_configs.KernelConfig``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .._configs import KernelConfig, option, scalar


@dataclasses.dataclass(frozen=True)
class NormForward(KernelConfig):
    """RMSNorm (``rms``) or LayerNorm forward. Dtype options are dtype names."""

    kernel_class = "norm:NormForward"
    kernels: ClassVar[dict] = {"rms_norm_fwd": {"rms": True}, "layer_norm_fwd": {"rms": False}}
    rms: bool = True
    residual: bool = option(False)
    weight: str | None = option()
    bias: str | None = option()
    out: str | None = option()
    staged: bool = option(True)  # row blocks prefetched through shared memory (one wave)
    eps: float = scalar(0.0)
    weight_offset: float | None = scalar()  # with a weight only


@dataclasses.dataclass(frozen=True)
class NormBackward(KernelConfig):
    """RMSNorm or LayerNorm backward: dx, and per-CTA partials of the weight and bias
    gradients; with ``summing`` also their sums, over the one cluster that is the grid."""

    kernel_class = "norm:NormBackward"
    kernels: ClassVar[dict] = {"rms_norm_bwd": {"rms": True}, "layer_norm_bwd": {"rms": False}}
    rms: bool = True
    weight: str | None = option()
    dy: str | None = option()
    dh: bool = option(False)
    weight_grad: bool = option(False)
    bias_grad: bool = option(False)
    summing: bool = option(False)  # launched as one cluster that sums its own partials
    weight_offset: float | None = scalar()  # with a weight only
