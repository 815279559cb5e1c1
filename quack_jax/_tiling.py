"""Launch geometry of the row-wise kernels, shared by the runtime and by ``kernels/``.

A row of ``n`` elements is split across ``cluster_n`` CTAs of a cluster; inside a CTA,
``threads_per_row`` threads share a row and each holds ``vecs_per_thread`` vectors of
``vec`` elements, strided so that a warp's accesses are contiguous. One CTA holds
``rows_per_cta`` rows. A streamed tiling (``group`` > 0, the cross-entropy forward and
backward) has each thread load and reduce its vectors ``group`` at a time, in ``steps``
passes over the CTA's columns, so that its registers hold one group whatever the row's
length. Everything here is plain Python: the runtime computes grids and
shared-memory sizes from it without importing CuTe-DSL, and the kernels read the same
numbers, so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from ._lowering import options

WARP = 32
MAX_CLUSTER = 16
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class RowTiling:
    n: int
    vec: int
    threads_per_row: int
    num_threads: int
    cluster_n: int
    group: int = 0  # streamed: vectors a thread loads and reduces at a time (0: all at once)

    def __post_init__(self):
        tpr, nt, cl = self.threads_per_row, self.num_threads, self.cluster_n
        problems = []
        if self.n < 1:
            problems.append("n must be positive")
        if self.vec < 1 or self.n % self.vec:
            problems.append("vec must divide n")
        if tpr < 1 or tpr & (tpr - 1) or tpr > nt:
            problems.append("threads_per_row must be a power of two <= num_threads")
        if nt % WARP or nt > 1024 or nt % tpr:
            problems.append("num_threads must be a multiple of 32, of threads_per_row, <= 1024")
        if cl not in (1, 2, 4, 8, 16):
            problems.append("cluster_n must be 1, 2, 4, 8 or 16")
        if self.group < 0:
            problems.append("group must be 0 (not streamed) or positive")
        if cl > 1 and tpr < WARP:
            problems.append("a cluster needs at least a warp per row")
        if not problems and cl > 1 and (cl - 1) * self.cols_per_cta >= self.n:
            problems.append("every CTA of a cluster must own part of the row")
        if problems:
            raise ValueError(f"invalid {self}: " + "; ".join(problems))

    @property
    def rows_per_cta(self) -> int:
        return self.num_threads // self.threads_per_row

    @property
    def vecs_per_thread(self) -> int:
        vecs = -(-self.n // (self.vec * self.threads_per_row * self.cluster_n))
        return round_up(vecs, self.group) if self.group else vecs

    @property
    def steps(self) -> int:
        """Passes over the CTA's columns: one group of vectors a thread each."""
        return self.vecs_per_thread // self.group if self.group else 1

    @property
    def step_cols(self) -> int:
        return self.cols_per_cta // self.steps

    @property
    def live_elems(self) -> int:
        """Row elements a thread holds in registers at once."""
        return self.group * self.vec if self.group else self.elems_per_thread

    @property
    def elems_per_thread(self) -> int:
        return self.vecs_per_thread * self.vec

    @property
    def cols_per_cta(self) -> int:
        return self.elems_per_thread * self.threads_per_row

    @property
    def warps_per_row(self) -> int:
        return max(self.threads_per_row // WARP, 1)

    def grid(self, m: int) -> tuple[int, int, int]:
        return (-(-m // self.rows_per_cta), self.cluster_n, 1)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.num_threads, 1, 1)

    @property
    def cluster(self) -> tuple[int, int, int]:
        return (1, self.cluster_n, 1)

    def reduction_slots(self) -> int:
        """Slots of the shared reduction buffer: one per (row, warp of the row, cluster rank)."""
        return self.rows_per_cta * self.warps_per_row * self.cluster_n

    def smem_bytes(self, words: int, copies: int = 1) -> int:
        """Dynamic shared memory: the mbarriers (clusters only), then ``copies`` reduction
        buffers (a kernel with several round trips in flight keeps one per round trip)."""
        needs_buffer = self.warps_per_row > 1 or self.cluster_n > 1
        buffer = self.reduction_slots() * words * 4 * copies if needs_buffer else 0
        barriers = round_up(8 * copies, 16) if self.cluster_n > 1 else 0
        return barriers + round_up(buffer, 16)

    @property
    def tag(self) -> str:
        group = f"g{self.group}" if self.group else ""
        return f"t{self.threads_per_row}x{self.num_threads}c{self.cluster_n}v{self.vec}{group}"


def round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def _pow2_at_least(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def max_vec(n: int, itemsize: int) -> int:
    """Widest access (elements, at most 16 bytes of ``itemsize``-byte elements) that keeps
    every row start aligned. A kernel that also reads wider elements (float32 weights
    with bfloat16 rows) passes the widest itemsize, so that every access fits 16 bytes."""
    return math.gcd(16 // itemsize, n)


def make_tiling(
    n: int,
    itemsize: int,
    threads_per_row: int,
    num_threads: int,
    cluster_n: int,
    step_elems: int = 0,
):
    """A tiling for rows of ``n`` elements of at most ``itemsize`` bytes, shrunk to fit
    small rows: fewer threads per row than vectors in it, and no more CTAs per row than
    can each own a part of it; with ``step_elems``, streamed in groups of that many
    elements a thread (no more than it has)."""
    vec = max_vec(n, itemsize)
    threads_per_row = min(threads_per_row, _pow2_at_least(-(-n // vec)))
    if threads_per_row < WARP:
        cluster_n = 1
    while True:
        tiling = RowTiling(n, vec, threads_per_row, num_threads, 1)
        vecs = -(-n // (vec * threads_per_row * cluster_n))
        group = min(max(step_elems // vec, 1), vecs) if step_elems else 0
        tiling = dataclasses.replace(tiling, group=group)
        per_cta = vec * threads_per_row * (round_up(vecs, group) if group else vecs)
        if cluster_n == 1 or (cluster_n - 1) * per_cta < n:
            return dataclasses.replace(tiling, cluster_n=cluster_n)
        cluster_n //= 2


K = 1024
# Register budget: float32 values a thread keeps live. A kernel keeps ``live`` values per
# element of its row slice (softmax forward: x; its derivative: x and the tangent; norms
# also weights, bias, residual, cotangents and weight-gradient accumulators), so it holds
# MAX_VALUES_PER_THREAD // live elements per thread.
MAX_VALUES_PER_THREAD = 128
# Streamed tilings apply from this many rows: enough to fill the GPU without a long row's
# cluster (docs/decisions/009-streamed-cross-entropy-tilings.md).
STREAM_MIN_ROWS = 2048
# Kernels that stage row blocks in shared memory (the persistent norm kernels) keep a
# CTA's block of all staged rows within twice this many bytes, and 3 * STAGE_BYTES of
# blocks in flight per CTA.
STAGE_BYTES = 32 * 1024


@dataclasses.dataclass(frozen=True, eq=False)  # each family is its own: hashed by identity
class TilingFamily:
    """The launch shapes of a kernel family: kernels that choose their tilings alike.

    Each op family declares its own (its ``tilings.py``); the tuner's tables are
    docs/decisions/008-tiling-tables.md.

    Attributes:
      name: the family's name in the benchmark's tables and the tuner's output.
      tables: by itemsize (2: the 16-bit dtypes, 4: float32), rows ``(limit, (threads
        per row, threads per CTA, cluster size))``: the first row whose limit holds the
        row length applies (longer rows take the last).
      live: float32 values a thread keeps per element of its row slice, for the register
        budget (``MAX_VALUES_PER_THREAD``); a kernel may pass its own.
      streamed: by itemsize, rows ``(limit, (threads per row, threads per CTA, cluster
        size, elements a thread per step) or None)`` for ``STREAM_MIN_ROWS`` rows or more
        (None: not streamed); rows longer than the last limit are not streamed.
      full_grid_up_to: by itemsize, the row length up to which a persistent kernel of the
        family launches one CTA per row block instead of one wave of clusters.
      dtype_tables: by dtype name, a table that replaces its itemsize's for that dtype,
        where the two 16-bit dtypes' best tilings differ.
    """

    name: str
    tables: dict[int, list]
    live: int = 1
    streamed: dict[int, list] = dataclasses.field(default_factory=dict)
    full_grid_up_to: dict[int, int] = dataclasses.field(default_factory=dict)
    dtype_tables: dict[str, list] = dataclasses.field(default_factory=dict)

    def __repr__(self):
        return f"TilingFamily({self.name!r})"

    def budget(self, live: int | None = None) -> int:
        """Row elements a thread may hold with ``live`` values each (default: the family's)."""
        return max(MAX_VALUES_PER_THREAD // (live or self.live), 8)

    def one_wave(self, n: int, itemsize: int) -> bool:
        """Whether a persistent kernel of this family launches one wave of clusters (else
        one CTA per row block: ``full_grid_up_to``)."""
        return n > self.full_grid_up_to.get(min(itemsize, 4), 0)

    def streamable(self, n: int, itemsize: int) -> bool:
        """Whether rows of ``n`` elements may stream: the family has streamed tables and
        the rows' vectors are at least 8 bytes."""
        return bool(self.streamed) and max_vec(n, itemsize) * itemsize >= 8

    def streamed_entry(self, n: int, itemsize: int, rows: int) -> tuple | None:
        """The streamed table's entry for these rows, or None where they are not streamed
        (rows longer than its last limit, the longest the kernels were tested on, included)."""
        table = self.streamed.get(min(itemsize, 4))
        if rows < STREAM_MIN_ROWS or table is None or not self.streamable(n, itemsize):
            return None
        return next((v for limit, v in table if n <= limit), None)


def _fits(tiling: RowTiling, budget: int, staged_bytes: int | None) -> bool:
    """Within the register budget, and for staged kernels (``staged_bytes`` per column of
    a row block, over all staged inputs) within 2 * STAGE_BYTES of shared memory per block."""
    block = tiling.rows_per_cta * tiling.cols_per_cta * (staged_bytes or 0)
    return tiling.live_elems <= budget and block <= 2 * STAGE_BYTES


def candidate_tilings(
    family: TilingFamily,
    n: int,
    itemsize: int,
    vec_itemsize: int | None = None,
    live: int | None = None,
    staged_bytes: int | None = None,
) -> list[RowTiling]:
    """The tilings the benchmark's tuner tries: for every mix of threads per row and CTA
    size, the two smallest clusters that fit the register budget, keeping each thread at
    least 32 elements (or 8 vectors, or the budget) so that enough loads are in flight;
    for the streamed families also streamed tilings (see ``_streamed_candidates``)."""
    budget = family.budget(live)
    vec = max_vec(n, max(itemsize, vec_itemsize or 0))
    out = []
    for tpr, threads in itertools.product(
        (8, 16, 32, 64, 128, 256, 512, 1024), (128, 256, 512, 1024)
    ):
        fitting = []
        for cluster in (1, 2, 4, 8, 16):
            try:
                tiling = RowTiling(n, vec, tpr, threads, cluster)
            except ValueError:
                continue
            if min(8 * vec, 32, budget // 2) <= tiling.elems_per_thread and _fits(
                tiling, budget, staged_bytes
            ):
                fitting.append(tiling)
        out += fitting[:2]
    if family.streamable(n, itemsize):
        out += _streamed_candidates(n, max(itemsize, vec_itemsize or 0))
    return out


def _streamed_candidates(n: int, itemsize: int) -> list[RowTiling]:
    """Streamed tilings of rows (of elements up to ``itemsize`` bytes) long enough to take
    several steps: a row per CTA of 128 to 1024 threads, on clusters of 1 to 8 CTAs, 16 or
    32 elements a thread per step."""
    out = []
    for tpr, cluster, elems in itertools.product((128, 256, 512, 1024), (1, 2, 4, 8), (16, 32)):
        tiling = make_tiling(n, itemsize, tpr, tpr, cluster, elems)
        if tiling.steps > 1 and tiling.cluster_n == cluster:
            out.append(tiling)
    return out


def choose_tiling(
    family: TilingFamily,
    n: int,
    itemsize: int,
    vec_itemsize: int | None = None,
    live: int | None = None,
    staged_bytes: int | None = None,
    rows: int = 0,
    dtype: str | None = None,
) -> RowTiling | None:
    """The tiling for a kernel family, or None when ``n`` is beyond what the kernels hold on chip.

    ``itemsize`` is the row dtype's and picks the table; ``vec_itemsize``, the widest
    element the kernel reads (weights), bounds the vector width; ``live`` values per
    element set the register budget (see ``TilingFamily.budget``), ``staged_bytes`` the
    shared memory of staged kernels (see ``_fits``); ``rows``, the number of rows, whether
    a streamed tiling applies (``TilingFamily.streamed``); ``dtype``, the row dtype's
    name, whether a table of its own applies (``TilingFamily.dtype_tables``). Else starts
    from the tables, then spreads a row over more threads (up to 256), then over more CTAs
    (up to 16, or as many as can share the row, and then over up to 1024 threads), until
    the tiling fits.
    """
    if tiling := options().tilings.get((family, n, itemsize)):
        return tiling
    table = family.dtype_tables.get(dtype) or family.tables[min(itemsize, 4)]
    vec_itemsize = max(itemsize, vec_itemsize or 0)
    if entry := family.streamed_entry(n, itemsize, rows):
        tpr, threads, cluster, step = entry
        return make_tiling(
            n, vec_itemsize, tpr, threads, cluster, step * family.live // (live or family.live)
        )
    tpr, threads, cluster = next((v for limit, v in table if n <= limit), table[-1][1])
    budget = family.budget(live)
    while True:
        tiling = make_tiling(n, vec_itemsize, tpr, threads, cluster)
        if _fits(tiling, budget, staged_bytes):
            return tiling
        if tpr < 256:
            tpr *= 2
            threads = max(threads, tpr)
        elif cluster < MAX_CLUSTER:
            cluster *= 2
        elif tpr < 1024 and tiling.cluster_n < MAX_CLUSTER:
            # a row that 16 CTAs cannot share (n = 151936 at 256 threads: the 16th CTA
            # would own nothing) goes to more threads of fewer CTAs
            tpr *= 2
            threads = max(threads, tpr)
        else:
            return None
