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

import contextlib
import dataclasses
import itertools
import math

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


# Launch shapes (threads per row, threads per CTA, cluster size) by row length: the first
# row whose limit holds n applies. Each entry is the tuner's fastest candidate at the
# benchmark size that ends its range: docs/decisions/008-tiling-tables.md.
_K = 1024
_TABLES = {
    ("softmax_fwd", 2): [
        (1 * _K, (16, 128, 1)),
        (4 * _K, (32, 128, 1)),
        (16 * _K, (256, 256, 1)),
        (64 * _K, (256, 256, 4)),
        (128 * _K, (128, 128, 16)),
        (256 * _K, (256, 256, 16)),
    ],
    ("softmax_fwd", 4): [
        (1 * _K, (16, 256, 1)),
        (4 * _K, (32, 128, 1)),
        (16 * _K, (64, 128, 4)),
        (64 * _K, (64, 128, 8)),
        (256 * _K, (128, 128, 16)),
    ],
    ("softmax_bwd", 2): [
        (1 * _K, (32, 256, 1)),
        (4 * _K, (64, 128, 1)),
        (16 * _K, (64, 128, 8)),
        (128 * _K, (128, 128, 16)),
        (256 * _K, (512, 512, 8)),
    ],
    ("softmax_bwd", 4): [
        (1 * _K, (32, 128, 1)),
        (4 * _K, (64, 128, 1)),
        (16 * _K, (64, 128, 8)),
        (128 * _K, (128, 128, 16)),
        (256 * _K, (256, 256, 16)),
    ],
}
# Norms, with float32 weights (and bias), tuned on the driver's persistent grids: RMSNorm
# and LayerNorm each have their own, since LayerNorm's two reductions and bias move its
# best tilings (docs/decisions/014-norm-tilings-and-direct-forward.md).
_TABLES["rms_norm_fwd", 2] = [
    (1 * _K, (32, 256, 1)),
    (4 * _K, (64, 128, 2)),
    (8 * _K, (128, 128, 2)),
    (16 * _K, (64, 128, 4)),
    (64 * _K, (64, 256, 16)),
]
_TABLES["rms_norm_fwd", 4] = [
    (1 * _K, (32, 256, 1)),
    (2 * _K, (32, 256, 1)),
    (4 * _K, (128, 256, 1)),
    (8 * _K, (128, 128, 2)),
    (16 * _K, (32, 256, 8)),
    (64 * _K, (128, 128, 8)),
]
_TABLES["rms_norm_bwd", 2] = [
    (1 * _K, (32, 128, 1)),
    (4 * _K, (256, 512, 1)),
    (8 * _K, (512, 512, 1)),
    (16 * _K, (128, 128, 8)),
    (64 * _K, (128, 128, 16)),
]
_TABLES["rms_norm_bwd", 4] = [
    (1 * _K, (32, 256, 1)),
    (4 * _K, (128, 512, 2)),
    (8 * _K, (256, 256, 1)),
    (16 * _K, (512, 512, 2)),
    (64 * _K, (128, 128, 16)),
]
_TABLES["layer_norm_fwd", 2] = [
    (1 * _K, (32, 128, 1)),
    (4 * _K, (64, 512, 2)),
    (8 * _K, (64, 256, 4)),
    (16 * _K, (128, 256, 4)),
    (64 * _K, (256, 256, 8)),
]
_TABLES["layer_norm_fwd", 4] = [
    (1 * _K, (32, 128, 1)),
    (2 * _K, (64, 256, 1)),
    (4 * _K, (128, 256, 1)),
    (8 * _K, (256, 256, 1)),
    (16 * _K, (64, 512, 8)),
    (64 * _K, (256, 256, 8)),
]
_TABLES["layer_norm_bwd", 2] = [
    (1 * _K, (64, 128, 1)),
    (4 * _K, (256, 256, 1)),
    (8 * _K, (128, 128, 4)),
    (16 * _K, (128, 256, 8)),
    (64 * _K, (256, 256, 16)),
]
_TABLES["layer_norm_bwd", 4] = [
    (1 * _K, (64, 512, 1)),
    (4 * _K, (256, 512, 1)),
    (8 * _K, (256, 256, 2)),
    (16 * _K, (256, 256, 4)),
    (64 * _K, (512, 512, 8)),
]
# Persistent kernels launch one wave of clusters, except for rows up to these lengths,
# where one CTA per row block measured faster: the float32 norm forwards up to n = 8192,
# which on that grid load their rows straight into registers (``kernels/norm.py``'s
# ``staged``), and whose table entries up to 8192 are tuned for that kernel. At 16384 and
# in bfloat16 one staged wave was as fast or faster:
# docs/decisions/014-norm-tilings-and-direct-forward.md.
_FULL_GRID_UP_TO = {("rms_norm_fwd", 4): 8 * _K, ("layer_norm_fwd", 4): 8 * _K}
# Cross-entropy: the forward reduces a row like softmax's forward (reads only); the
# backward is elementwise, so long rows are split into column blocks of separate CTAs
# (``cluster_n`` of them, launched without a cluster) of about 32 elements a thread.
_TABLES["ce_fwd", 2] = _TABLES["softmax_fwd", 2]
_TABLES["ce_fwd", 4] = _TABLES["softmax_fwd", 4]
# the forward with the entropy (token_logprobs): two live values an element
_TABLES["ce_entropy", 2] = _TABLES["softmax_fwd", 2]
_TABLES["ce_entropy", 4] = _TABLES["softmax_fwd", 4]
_TABLES["ce_bwd", 2] = [
    (1 * _K, (32, 256, 1)),
    (2 * _K, (64, 256, 1)),
    (4 * _K, (128, 256, 1)),
    (8 * _K, (256, 256, 1)),
    (16 * _K, (256, 256, 2)),
    (32 * _K, (256, 256, 4)),
    (64 * _K, (256, 256, 8)),
    (256 * _K, (256, 256, 16)),
]
_TABLES["ce_bwd", 4] = _TABLES["ce_bwd", 2]
# Streamed tilings (threads per row, threads per CTA, cluster size, elements a thread per
# step) of the families that have them, for rows up to each limit (None: not streamed),
# at STREAM_MIN_ROWS rows or more: enough rows to fill the GPU without a long row's
# cluster, where a thread that holds one group of its row at a time lets several CTAs
# share an SM. Fewer rows, and rows whose vectors are under 8 bytes (n = 50257, say, which
# streams slower than it runs held in registers), take the tables above. A kernel with
# more live values per element than its family's (the forward with label smoothing)
# takes proportionally fewer elements per step. Tuned at 2048 to 8192 rows:
# docs/decisions/009-streamed-cross-entropy-tilings.md.
STREAM_MIN_ROWS = 2048
_STREAMED_TABLES = {
    ("ce_fwd", 2): [(16 * _K, None), (128 * _K, (128, 128, 1, 32)), (256 * _K, (256, 256, 1, 32))],
    ("ce_entropy", 2): [(16 * _K, None), (256 * _K, (128, 128, 1, 16))],
    ("ce_bwd", 2): [
        (16 * _K, None),
        (64 * _K, (512, 512, 1, 32)),
        (160 * _K, (1024, 1024, 1, 32)),
        (256 * _K, (512, 512, 1, 32)),
    ],
}
STREAMED = frozenset(family for family, _ in _STREAMED_TABLES)


# The forward that also writes the gradient (a mean or sum loss under autodiff) reads and
# writes the row, so it has a table of its own, tuned alone at n = 1024, 32000, 50257,
# 128256, 151936 and 262144, the softmax forward's entries between them:
# docs/decisions/011-cross-entropy-forward-writes-gradient.md.
_TABLES["ce_grad", 2] = [
    (1 * _K, (32, 256, 1)),
    (4 * _K, (32, 128, 1)),
    (16 * _K, (256, 256, 1)),
    (32 * _K, (256, 256, 4)),
    (128 * _K, (128, 128, 8)),
    (160 * _K, (1024, 1024, 4)),
    (256 * _K, (128, 128, 16)),
]
_TABLES["ce_grad", 4] = [
    (1 * _K, (32, 128, 1)),
    (4 * _K, (32, 128, 1)),
    (16 * _K, (64, 128, 4)),
    (32 * _K, (128, 128, 4)),
    (64 * _K, (128, 128, 8)),
    (256 * _K, (128, 128, 16)),
]
# Register budget: float32 values a thread keeps live. A kernel keeps ``live`` values per
# element of its row slice (softmax forward: x; its derivative: x and the tangent; norms
# also weights, bias, residual, cotangents and weight-gradient accumulators), so it holds
# budget // live elements per thread.
_MAX_VALUES_PER_THREAD = {
    "softmax_fwd": 128,
    "softmax_bwd": 128,
    "rms_norm_fwd": 128,
    "rms_norm_bwd": 128,
    "layer_norm_fwd": 128,
    "layer_norm_bwd": 128,
    "ce_fwd": 128,
    "ce_entropy": 128,
    "ce_bwd": 128,
    "ce_grad": 128,
}
_LIVE = {
    "softmax_fwd": 1,
    "softmax_bwd": 2,
    "ce_fwd": 1,
    "ce_entropy": 2,
    "ce_bwd": 2,
    "ce_grad": 1,
}


# Kernels that stage row blocks in shared memory (the persistent norm kernels) keep a
# CTA's block of all staged rows within twice this many bytes, and 3 * STAGE_BYTES of
# blocks in flight per CTA.
STAGE_BYTES = 32 * 1024


def elems_budget(family: str, live: int | None = None) -> int:
    return max(_MAX_VALUES_PER_THREAD[family] // (live or _LIVE.get(family, 1)), 8)


def _fits(tiling: RowTiling, budget: int, staged_bytes: int | None) -> bool:
    """Within the register budget, and for staged kernels (``staged_bytes`` per column of
    a row block, over all staged inputs) within 2 * STAGE_BYTES of shared memory per block."""
    block = tiling.rows_per_cta * tiling.cols_per_cta * (staged_bytes or 0)
    return tiling.live_elems <= budget and block <= 2 * STAGE_BYTES


def one_wave(family: str, n: int, itemsize: int) -> bool:
    """Whether a persistent kernel of this family launches one wave of clusters (else one
    CTA per row block: ``_FULL_GRID_UP_TO``)."""
    return n > _FULL_GRID_UP_TO.get((family, min(itemsize, 4)), 0)


_overrides: dict[tuple[str, int, int], RowTiling] = {}


@contextlib.contextmanager
def override_tiling(family: str, n: int, itemsize: int, tiling: RowTiling):
    """Use ``tiling`` for this kernel family and size while tracing inside the block (tuning)."""
    key = (family, n, itemsize)
    previous = _overrides.get(key)
    _overrides[key] = tiling
    try:
        yield
    finally:
        if previous is None:
            del _overrides[key]
        else:
            _overrides[key] = previous


def candidate_tilings(
    family: str,
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
    budget = elems_budget(family, live)
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
    if _streamable(family, n, itemsize):
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


def _streamable(family: str, n: int, itemsize: int) -> bool:
    return family in STREAMED and max_vec(n, itemsize) * itemsize >= 8


def _streamed_entry(family: str, n: int, itemsize: int, rows: int) -> tuple | None:
    """The streamed table's entry for these rows, or None where they are not streamed
    (rows longer than its last limit, the longest the kernels were tested on, included)."""
    table = _STREAMED_TABLES.get((family, min(itemsize, 4)))
    if rows < STREAM_MIN_ROWS or table is None or not _streamable(family, n, itemsize):
        return None
    return next((v for limit, v in table if n <= limit), None)


def choose_tiling(
    family: str,
    n: int,
    itemsize: int,
    vec_itemsize: int | None = None,
    live: int | None = None,
    staged_bytes: int | None = None,
    rows: int = 0,
) -> RowTiling | None:
    """The tiling for a kernel family, or None when ``n`` is beyond what the kernels hold on chip.

    ``itemsize`` is the row dtype's and picks the table; ``vec_itemsize``, the widest
    element the kernel reads (weights), bounds the vector width; ``live`` values per
    element set the register budget (see ``elems_budget``), ``staged_bytes`` the shared
    memory of staged kernels (see ``_fits``); ``rows``, the number of rows, whether a
    streamed tiling applies (``_STREAMED_TABLES``). Else starts from the tables, then
    spreads a row over more threads (up to 256), then over more CTAs (up to 16, or as many
    as can share the row, and then over up to 1024 threads), until the tiling fits.
    """
    if tiling := _overrides.get((family, n, itemsize)):
        return tiling
    table = _TABLES[family, min(itemsize, 4)]
    vec_itemsize = max(itemsize, vec_itemsize or 0)
    if entry := _streamed_entry(family, n, itemsize, rows):
        tpr, threads, cluster, step = entry
        default_live = _LIVE.get(family, 1)
        return make_tiling(
            n, vec_itemsize, tpr, threads, cluster, step * default_live // (live or default_live)
        )
    tpr, threads, cluster = next((v for limit, v in table if n <= limit), table[-1][1])
    budget = elems_budget(family, live)
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
