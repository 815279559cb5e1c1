"""Kernel configurations: one frozen dataclass per kernel class.

A configuration's fields are, in one order, what selects the kernel op (plain fields,
such as ``rms``), the kernel's options and its scalars:

- **Options** are fixed when the kernel is compiled: the variant. The cubin cache names a
  kernel by the options that differ from their defaults, and the kernel class is built
  with all of them as keyword arguments.
- **Scalars** are the run-time arguments that follow the row count ``m``, in the order the
  kernel's ``__call__`` takes them. A scalar field's ``kernel`` name is its parameter
  there. A value of None means the argument is absent: it is not passed, and the kernel
  compiles without it.

The op module that launches a kernel fills in a configuration by name. The launcher takes
the variant and the scalars from it (``_primitive.kernel_call``). ``tests/test_build.py``
checks each kernel's signature against these fields. Plain Python: no JAX, no CuTe-DSL.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def option(default: Any = None):
    """A compile-time option of the kernel (a keyword argument of its class)."""
    return dataclasses.field(default=default, metadata={"kind": "option"})


def scalar(default: Any = None, *, kernel: str | None = None):
    """A run-time scalar of the kernel; ``kernel`` names its parameter where the names
    differ."""
    return dataclasses.field(default=default, metadata={"kind": "scalar", "kernel": kernel})


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    @property
    def op(self) -> str:
        """The kernel op: the key of ``quack_jax.kernels.KERNELS``."""
        raise NotImplementedError

    @classmethod
    def _fields(cls, kind: str):
        return [f for f in dataclasses.fields(cls) if f.metadata.get("kind") == kind]

    def variant(self) -> tuple[tuple[str, Any], ...]:
        """The options that differ from their defaults, in field order: what the cubin
        cache names the kernel by and what its class is built with."""
        fields = self._fields("option")
        return tuple(
            (f.name, getattr(self, f.name)) for f in fields if getattr(self, f.name) != f.default
        )

    def scalars(self) -> tuple:
        """The scalar arguments that are present, in order."""
        values = (getattr(self, f.name) for f in self._fields("scalar"))
        return tuple(v for v in values if v is not None)

    @classmethod
    def scalar_names(cls) -> tuple[str, ...]:
        """Every scalar's parameter name in the kernel, in order."""
        return tuple(f.metadata["kernel"] or f.name for f in cls._fields("scalar"))


@dataclasses.dataclass(frozen=True)
class Softmax(KernelConfig):
    """``softmax_fwd`` / ``log_softmax_fwd``: y from x."""

    log: bool = False

    @property
    def op(self) -> str:
        return "log_softmax_fwd" if self.log else "softmax_fwd"


@dataclasses.dataclass(frozen=True)
class SoftmaxDerivative(KernelConfig):
    """The derivative kernels, linear in t: ``kind`` is "softmax", "log_vjp" or
    "log_jvp"."""

    kind: str = "softmax"

    @property
    def op(self) -> str:
        ops = {"softmax": "softmax_bwd", "log_vjp": "log_softmax_bwd", "log_jvp": "log_softmax_jvp"}
        return ops[self.kind]


@dataclasses.dataclass(frozen=True)
class NormForward(KernelConfig):
    """RMSNorm (``rms``) or LayerNorm forward. Dtype options are dtype names."""

    rms: bool = True
    residual: bool = option(False)
    weight: str | None = option()
    bias: str | None = option()
    out: str | None = option()
    eps: float = scalar(0.0)
    offset: float | None = scalar()  # with a weight only

    @property
    def op(self) -> str:
        return "rms_norm_fwd" if self.rms else "layer_norm_fwd"


@dataclasses.dataclass(frozen=True)
class NormBackward(KernelConfig):
    """RMSNorm or LayerNorm backward: dx, and per-CTA partials of the weight and bias
    gradients."""

    rms: bool = True
    weight: str | None = option()
    dy: str | None = option()
    dh: bool = option(False)
    weight_grad: bool = option(False)
    bias_grad: bool = option(False)
    offset: float | None = scalar()  # with a weight only

    @property
    def op(self) -> str:
        return "rms_norm_bwd" if self.rms else "layer_norm_bwd"


@dataclasses.dataclass(frozen=True)
class CrossEntropyForward(KernelConfig):
    """Per-row loss and lse, and with ``grad`` the gradient of ``sum(w * loss)``."""

    smoothing: bool = option(False)
    softcap: bool = option(False)
    grad: bool = option(False)
    ignore_index: int = scalar(-100)
    label_smoothing: float = scalar(0.0, kernel="smoothing")
    z_loss: float = scalar(0.0)
    cap: float = scalar(0.0)

    op = "cross_entropy_fwd"


@dataclasses.dataclass(frozen=True)
class CrossEntropyBackward(KernelConfig):
    """dlogits from the logits, lse and per-row coefficients."""

    softcap: bool = option(False)
    cap: float = scalar(0.0)

    op = "cross_entropy_bwd"
