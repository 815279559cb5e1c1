"""The options of the lowering: the choices that the tests, the build and the benchmark
make for quack_jax's primitives while a function is lowered, in one place.

``lowering(**options)`` sets any of them for a block (blocks nest: the outer values come
back when a block ends, also on an error) and ``options()`` reads the current ones. They
apply when a function is lowered: one that jit has already compiled keeps the options it
was lowered with. Outside every block the defaults hold, which is how a program runs.
Plain Python: no JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses

PATHS = ("auto", "kernel", "reference")
ROW_REGIMES = ("many", "few")


@dataclasses.dataclass(frozen=True)
class LoweringOptions:
    """The lowering's options.

    Attributes:
      path: where primitives lower: "auto" (kernels, except at the shapes where XLA's
        formulation measured faster, ``_primitive.REFERENCE_FASTER``), "kernel" (kernels
        wherever they apply: the tests and the benchmark's kernel columns) or "reference"
        (XLA's formulation everywhere).
      regime: None, or one of ``ROW_REGIMES``: every choice that depends on the number of
        rows takes the count its caller names for that regime instead of the true one
        (``_primitive.counted``), so that a build lowered once in each holds the kernels
        of any number of rows (docs/decisions/007-row-regimes.md).
      one_wave: None (each family's rule, ``_tiling.one_wave``), or whether persistent
        kernels are launched on one wave of clusters (True) or on one CTA per row block
        (False): the benchmark's tuner times both (``_primitive.grid_is_one_wave``).
      tilings: the tiling (a ``_tiling.RowTiling``) that a kernel family takes at a row
        length and itemsize, by ``(family, n, itemsize)``, instead of its table's: the
        tuner's candidates (``_tiling.choose_tiling``).
      recorders: dicts into which ``_cache.get_kernel`` puts each kernel it returns, as
        ``(op, dtype, tiling, variant)`` (``_cache.kernels_used``).
    """

    path: str = "auto"
    regime: str | None = None
    one_wave: bool | None = None
    tilings: dict = dataclasses.field(default_factory=dict)
    recorders: tuple[dict, ...] = ()

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {self.path!r}")
        if self.regime not in (None, *ROW_REGIMES):
            raise ValueError(f"regime must be one of {ROW_REGIMES} or None, got {self.regime!r}")


_current = LoweringOptions()


def options() -> LoweringOptions:
    """The options in force."""
    return _current


@contextlib.contextmanager
def lowering(**changes):
    """Inside the block, the options are the outer ones with ``changes`` (fields of
    ``LoweringOptions``)."""
    global _current
    outer, _current = _current, dataclasses.replace(_current, **changes)
    try:
        yield
    finally:
        _current = outer


def lowering_path(path: str):
    """Inside the block, primitives lower to ``path``: "auto", "kernel" or "reference"
    (see ``LoweringOptions.path``)."""
    return lowering(path=path)
