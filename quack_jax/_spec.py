"""What an op family declares once, for the tools around it (build, prebuild, bench, the
cache's error message, the tests); ``_registry.FAMILIES`` lists the families."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax

from ._tiling import RowTiling, TilingFamily, candidate_tilings, choose_tiling

# (op, dtype, n, packaged) -> (fn, args): functions whose lowering for CUDA launches, so
# builds, the op's kernels for rows of length n (args: jax.ShapeDtypeStruct); with
# ``packaged``, only the variants that ship in the wheel
Lowerings = Callable[[str, str, int, bool], Iterable[tuple[Callable, tuple]]]

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The row lengths an op's tests run on one backend: the grid of every (rows, row
    length, dtype), the special-value cases' row lengths, and ``others``, those of the
    single tests beyond them (sharded rows, every option mix, odd vocabularies). The
    gpu tests launch only kernels that the family's ``lowerings`` build at ``lengths``."""

    rows: tuple[int, ...]
    sizes: tuple[int, ...]
    dtypes: tuple[str, ...] = DTYPES
    special: tuple[int, ...] = ()
    others: tuple[int, ...] = ()

    @property
    def lengths(self) -> list[int]:
        """Every row length the tests run, once."""
        return sorted({*self.sizes, *self.special, *self.others})


@dataclasses.dataclass(frozen=True, eq=False)  # each spec is its own: hashed by identity
class OpSpec:
    """An op family: its public ops, the configurations of the kernels it launches, the
    column of ``build.COMMON_MODELS`` (or the sequence lengths) that sets the row lengths
    of its packaged kernels, the functions that build its kernels, its test grid per
    backend ("cpu": the XLA fallback, "gpu": the kernels) and its benchmarks."""

    ops: tuple[str, ...]
    configs: tuple[type, ...]  # its kernels' configurations (``_configs.KernelConfig``)
    sizes: str  # "sequence", "hidden" or "vocab"
    lowerings: Lowerings
    tests: dict[str, Shapes]
    # the op's benchmarks (``python -m quack_jax.bench``), made when the benchmark runs
    benchmarks: Callable[[], list[Benchmark]] | None = None

    def test_lowerings(self, backend: str = "gpu"):
        """(op, dtype, n, fn, args) for every function whose lowering builds the kernels
        that the backend's tests launch: ``lowerings`` of each op at each dtype and row
        length of its test shapes."""
        shapes = self.tests[backend]
        for op in self.ops:
            for dtype in shapes.dtypes:
                for n in shapes.lengths:
                    for fn, args in self.lowerings(op, dtype, n, False):
                        yield op, dtype, n, fn, args


# -- how an op is benchmarked (``python -m quack_jax.bench``) ----------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed function of the op's arguments (the last argument is the cotangent dy)."""

    key: str  # the row's entry: seconds per application
    label: str  # the plot's legend
    passes: int  # bytes it must move, in units of M*N*e
    fn: Callable
    args: int | None = None  # it takes the arguments [:args]: -1 leaves dy out
    kernel: bool = False  # a quack_jax path: on a kernel device it must launch kernels


@dataclasses.dataclass(frozen=True)
class Tuned:
    """A kernel family: the table's tiling column, and what ``--tune`` times alone."""

    # the row entries tiling_<name> and tune_<name>; where it is the kernel op's suffix
    # ("fwd", "bwd"), ``prebuild.py --tune`` finds the tiling the benchmark launches by it
    name: str
    family: TilingFamily
    passes: int
    fn: Callable
    prepare: Callable  # the op's arguments -> fn's
    live: Callable[[], int] | None = None  # float32 values per element: the register budget
    staged_rows: int = 0  # row inputs staged in shared memory (persistent kernels)
    # time the candidates on one wave and on one CTA per row block, where the norm forward
    # loads its rows straight into registers (no staging)
    full_grid: bool = False

    def grids(self, n: int, itemsize: int) -> tuple[bool, ...]:
        """The grids the candidates are timed on, as ``LoweringOptions.one_wave``:
        the one the op launches first."""
        launched = self.family.one_wave(n, itemsize)
        return (launched, not launched) if self.full_grid else (True,)

    def candidates(
        self, n: int, itemsize: int, default: RowTiling | None, one_wave: bool = True
    ) -> list[RowTiling]:
        """The tuner's candidates on a grid: the tiling the op launches (``default``; for a
        kernel that the benchmark's paths do not launch, the family's choice), then the
        library's candidate tilings of the same vector width (within the staged rows'
        shared memory on one wave)."""
        default = default or choose_tiling(self.family, n, itemsize)
        budget = {} if self.live is None else {"live": self.live()}
        if self.staged_rows and one_wave:
            budget["staged_bytes"] = self.staged_rows * itemsize
        found = candidate_tilings(self.family, n, itemsize, 16 // default.vec, **budget)
        return list(dict.fromkeys([default, *found]))

    def runs(self, n: int, itemsize: int, default: RowTiling | None) -> list[tuple]:
        """What the tuner times, and ``prebuild.py --tune`` builds: (tag, tiling,
        one_wave) for each candidate on each grid; the tag ends in +full-grid on one CTA
        per row block."""
        return [
            (tiling.tag + ("" if one_wave else "+full-grid"), tiling, one_wave)
            for one_wave in self.grids(n, itemsize)
            for tiling in self.candidates(n, itemsize, default, one_wave)
        ]


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """How ``python -m quack_jax.bench`` times an op: its shapes, the timed functions, the
    kernels ``--tune`` times alone, the table's columns."""

    name: str
    shapes: list[tuple[int, int]]
    quick_shapes: list[tuple[int, int]]  # --quick
    arguments: Callable  # (m, n, dtype) -> the (shape, dtype) of each argument, dy last
    cases: list[Case]
    tuned: list[Tuned]
    columns: list[tuple]  # (header, kind, *row keys); see ``cell``
    footprint: int  # M x N arrays alive per input while timing (memory budget)
    # --latency: microseconds per op at small and decode shapes (see ``latency``)
    latency_shapes: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    # --latency's rows: a decode step's tokens (1, 8, 64) up to a small batch's
    LATENCY_ROWS = (1, 8, 64, 512, 4096)

    @classmethod
    def latency(cls, sizes) -> list[tuple[int, int]]:
        """(M, N) for each row length N of ``sizes``, and M in ``LATENCY_ROWS``."""
        return [(m, n) for n in sizes for m in cls.LATENCY_ROWS]

    @property
    def passes(self) -> dict[str, int]:
        return {"copy": 2} | {c.key: c.passes for c in self.cases}


def fwd_bwd(fn):
    """``jax.vjp`` of ``fn`` w.r.t. all its arguments, given the cotangent as the last
    argument: fn's result and the gradients (the forward is not dead code)."""

    def f(*args):
        y, vjp = jax.vjp(fn, *args[:-1])
        return y, vjp(args[-1])

    return f


FWD_COLUMNS = [
    ("copy TB/s", "rate", "copy"),
    ("quack fwd TB/s", "rate", "quack_fwd"),
    ("XLA fwd TB/s", "rate", "xla_fwd"),
    ("fwd speedup", "speedup", "xla_fwd", "quack_fwd"),
]
FWD_BWD_COLUMNS = [
    ("quack fwd+bwd TB/s", "rate", "quack_fwd_bwd"),
    ("XLA fwd+bwd TB/s", "rate", "xla_fwd_bwd"),
    ("fwd+bwd speedup", "speedup", "xla_fwd_bwd", "quack_fwd_bwd"),
]
TILINGS = ("tilings (fwd, bwd)", "tilings")
