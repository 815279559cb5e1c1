"""What an op family declares once, for the tools around it (build, prebuild, the cache's
error message); ``_registry.FAMILIES`` lists the families."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

# (op, dtype, n, packaged) -> (fn, args): functions whose lowering for CUDA launches, so
# builds, the op's kernels for rows of length n (args: jax.ShapeDtypeStruct); with
# ``packaged``, only the variants that ship in the wheel
Lowerings = Callable[[str, str, int, bool], Iterable[tuple[Callable, tuple]]]


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """An op family: its public ops, the column of ``build.COMMON_MODELS`` (or the
    sequence lengths) that sets the row lengths of its packaged kernels, and the functions
    that build its kernels."""

    ops: tuple[str, ...]
    sizes: str  # "sequence", "hidden" or "vocab"
    lowerings: Lowerings
