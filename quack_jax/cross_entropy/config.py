"""The cross-entropy kernels' configurations (``_configs.KernelConfig``), filled in from
the options."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .._configs import KernelConfig, option, scalar
from .options import CrossEntropyOptions


@dataclasses.dataclass(frozen=True)
class CrossEntropyForward(KernelConfig):
    """Per-row loss and statistics, and with ``grad`` the gradient of ``sum(w * loss)``."""

    kernel_class = "cross_entropy:CrossEntropyForward"
    kernels: ClassVar[dict] = {"cross_entropy_fwd": {}}
    smoothing: bool = option(False)
    softcap: bool = option(False)
    grad: bool = option(False)
    entropy: bool = option(False)
    ignore_index: int = scalar(-100)
    label_smoothing: float = scalar(0.0)
    z_loss: float = scalar(0.0)
    logit_softcap: float = scalar(0.0)
    inv_temperature: float = scalar(1.0)

    @classmethod
    def of(cls, options: CrossEntropyOptions, *, grad: bool, entropy: bool):
        return cls(
            smoothing=bool(options.label_smoothing),
            softcap=options.logit_softcap is not None,
            grad=grad,
            entropy=entropy,
            ignore_index=options.ignore_index,
            label_smoothing=options.label_smoothing,
            z_loss=options.z_loss,
            logit_softcap=float(options.logit_softcap or 0.0),
            inv_temperature=1.0 / options.temperature,
        )


@dataclasses.dataclass(frozen=True)
class CrossEntropyBackward(KernelConfig):
    """dlogits from the logits, the row statistics and per-row coefficients."""

    kernel_class = "cross_entropy:CrossEntropyBackward"
    kernels: ClassVar[dict] = {"cross_entropy_bwd": {}}
    softcap: bool = option(False)
    entropy: bool = option(False)
    logit_softcap: float = scalar(0.0)
    inv_temperature: float = scalar(1.0)

    @classmethod
    def of(cls, options: CrossEntropyOptions, *, entropy: bool):
        return cls(
            softcap=options.logit_softcap is not None,
            entropy=entropy,
            logit_softcap=float(options.logit_softcap or 0.0),
            inv_temperature=1.0 / options.temperature,
        )
