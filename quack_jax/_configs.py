"""Kernel configurations: the base of the frozen dataclass that each op family declares
per kernel class (next to the op, in the family's module; its ``SPEC.configs``).

A configuration names its kernel class (``kernel_class``) and the kernel ops it is
(``kernels``: each op's name and the values of the selecting fields). Its fields are,
in one order, what selects the kernel op (plain fields, such as ``rms``; they are also
keyword arguments of the kernel class), the kernel's options and its scalars:

- **Options** are fixed when the kernel is compiled: the variant. The cubin cache names a
  kernel by the options that differ from their defaults, and the kernel class is built
  with all of them as keyword arguments.
- **Scalars** are the run-time arguments that follow the row count ``m``: the kernel's
  parameters of the same names, in the same order, each a 32-bit int or float as its
  annotation says (``int``; ``float`` or ``float | None``). A value of None means the
  argument is absent: it is not passed, and the kernel compiles without it.

The op module that launches a kernel fills in a configuration by name. The launcher takes
the variant and the scalars from it (``_primitive.kernel_call``), the kernel class its
scalars' names and types (``scalar_types``). ``tests/test_build.py`` checks each kernel's
signature against these fields. Plain Python: no JAX, no CuTe-DSL.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar


def option(default: Any = None):
    """A compile-time option of the kernel (a keyword argument of its class)."""
    return dataclasses.field(default=default, metadata={"kind": "option"})


def scalar(default: Any = None):
    """A run-time scalar of the kernel (its parameter of the same name)."""
    return dataclasses.field(default=default, metadata={"kind": "scalar"})


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    # "module:Class": a module of quack_jax.kernels by its name, any other by its full
    # path; resolved only when a kernel compiles (docs/decisions/022)
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
    def scalar_types(cls) -> dict[str, type]:
        """Every scalar's name and type (int or float), in order."""
        hints = typing.get_type_hints(cls)
        return {f.name: _word(hints[f.name]) for f in cls._fields("scalar")}


def _word(annotation) -> type:
    """The type of a scalar annotated ``annotation``: ``float | None`` is float."""
    (word,) = set(typing.get_args(annotation) or (annotation,)) - {type(None)}
    assert word in (int, float), f"a scalar is an int or a float, not {word}"
    return word
