"""Kernel configurations: the base of the frozen dataclass that each op family declares
per kernel class (next to the op, in the family's module; its ``SPEC.configs``).

A configuration names its kernel class (``kernel_class``) and the kernel ops it is
(``kernels``: each op's name and the values of the selecting fields). Its fields are,
in one order, what selects the kernel op (plain fields, such as ``rms``; they are also
keyword arguments of the kernel class), the kernel's options and its scalars:

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
from typing import Any, ClassVar


def option(default: Any = None):
    """A compile-time option of the kernel (a keyword argument of its class)."""
    return dataclasses.field(default=default, metadata={"kind": "option"})


def scalar(default: Any = None, *, kernel: str | None = None):
    """A run-time scalar of the kernel; ``kernel`` names its parameter where the names
    differ."""
    return dataclasses.field(default=default, metadata={"kind": "scalar", "kernel": kernel})


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    # "module:Class": a module of quack_jax.kernels by its name, any other by its full path
    kernel_class: ClassVar[str]
    # kernel op -> the selecting fields' values that make it
    kernels: ClassVar[dict[str, dict[str, Any]]]

    @property
    def op(self) -> str:
        """The kernel op (what the cubin cache names the kernel by)."""
        selected = {f.name: getattr(self, f.name) for f in self._fields(None)}
        return next(op for op, values in self.kernels.items() if values == selected)

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
