"""The linear map's options (``LinearOptions``): how a chunk's (or a vocabulary slice's)
logits are made from its rows, checked once from the public arguments with h, the
weight and the bias."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._checks import float_array
from .._partition import varying_like

# the default chunk: rows whose logits take at most CHUNK_BYTES, but at least
# CHUNK_MIN_ROWS rows, and at most CHUNK_FREE_FRACTION of the free device memory, a
# multiple of CHUNK_MULTIPLE rows: large enough that each chunk's GEMMs run near the
# whole-T GEMMs' speed, small next to XLA's whole logits
# (docs/decisions/017-linear-cross-entropy-chunks.md, 027-chunks-of-at-least-2048-rows.md)
CHUNK_BYTES = 1 << 30
CHUNK_MIN_ROWS = 2048
CHUNK_FREE_FRACTION = 1 / 8
CHUNK_MULTIPLE = 128
_PRECISIONS = tuple(p.name for p in lax.Precision)
# a vocabulary that is not a multiple of ALIGNED_VOCAB (GPT-2's 50257) leaves the rows of
# the weight and of the logits misaligned for the tensor cores, and cuBLAS's GEMMs run at
# a third of their speed; the GEMMs then take the weight padded with zeros to a multiple
# of PADDED_VOCAB (docs/decisions/023-padded-vocabulary.md)
ALIGNED_VOCAB = 8
PADDED_VOCAB = 64
# per-row losses, lse and linear_token_logprobs go over slices of the vocabulary (as many
# as there would be chunks of rows, rounded up to a power of two, so that the slices'
# widths are few enough for the wheel to carry their kernels: equal parts of it, where
# they are a multiple of ALIGNED_VOCAB wide; else SLICE_MULTIPLE columns wide but the
# last) where one slice holds it or where the float32 dh they sum is no larger than the
# row chunks' float32 dW (tokens <= vocabulary); the last KEEP_FRACTION of the slices
# (all of one) keep their logits from the forward pass for the backward, within
# KEEP_FREE_FRACTION of the free device memory
# (docs/decisions/028-per-row-losses-over-vocabulary-slices.md)
SLICE_MULTIPLE = 128
KEEP_FRACTION = 1 / 2
KEEP_FREE_FRACTION = 1 / 4


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Slices:
    """The per-row path's slices of the vocabulary: their ``widths`` (of the whole
    vocabulary; a device that holds 1/count of it takes 1/count of each slice), of which
    the last ``kept`` keep their logits from the forward pass for the backward."""

    widths: tuple[int, ...]
    kept: int

    def local(self, count: int) -> tuple[int, ...]:
        return tuple(w // count for w in self.widths)

    def divides(self, count: int) -> bool:
        """Whether ``count`` devices can split every slice evenly."""
        return all(w % count == 0 for w in self.widths)


@dataclasses.dataclass(frozen=True)
class LinearOptions:
    """How a chunk's logits are made from its rows ``h`` (rows, d): ``h @ W`` with W of
    shape (d, V), or (V, d) with ``transpose_weight``, plus an optional bias;
    ``chunk_size`` rows at a time (per-row losses: as many vocabulary ``slices``), GEMMs
    at ``precision``, logits of ``preferred_element_type`` (a dtype name). The backward
    GEMMs take dlogits in h's dtype and accumulate in float32."""

    transpose_weight: bool
    chunk_size: int
    preferred_element_type: str
    precision: Any = None

    def _dot(self, a, b, contract, dtype):
        return lax.dot_general(
            a, b, (contract, ((), ())), precision=self.precision, preferred_element_type=dtype
        )

    def slices(self, rows: int, vocab: int, keep: bool) -> Slices | None:
        """The per-row path's vocabulary slices for ``rows`` tokens, or None where it goes
        in chunks of rows; with ``keep``, how many keep their logits (every one where one
        slice holds the vocabulary, docs/decisions/025-one-chunk-keeps-its-logits.md)."""
        count = -(-rows // self.chunk_size) if rows else 1
        if count > 1 and rows > vocab:
            return None
        widths = slice_widths(vocab, 1 << (count - 1).bit_length())
        if not keep:
            return Slices(widths, 0)
        if len(widths) == 1:
            return Slices(widths, 1)
        kept = int(len(widths) * KEEP_FRACTION)
        free = _free_bytes()
        if free is not None:
            itemsize = np.dtype(self.preferred_element_type).itemsize
            kept = min(kept, int(free * KEEP_FREE_FRACTION) // max(rows * widths[0] * itemsize, 1))
        return Slices(widths, kept)

    @property
    def vocab_axis(self) -> int:
        return 0 if self.transpose_weight else 1

    def vocab(self, w) -> int:
        return w.shape[self.vocab_axis]

    def padded(self, w, bias):
        """The weight and the bias as the GEMMs take them: with zeros appended along the
        vocabulary up to a multiple of PADDED_VOCAB where it is not a multiple of
        ALIGNED_VOCAB; as they are otherwise."""
        extra = -self.vocab(w) % PADDED_VOCAB if self.vocab(w) % ALIGNED_VOCAB else 0
        if not extra:
            return w, bias
        widths = ((0, extra), (0, 0)) if self.transpose_weight else ((0, 0), (0, extra))
        return jnp.pad(w, widths), None if bias is None else jnp.pad(bias, (0, extra))

    def logits(self, h, w, bias):
        dtype = self.preferred_element_type
        z = self._dot(h, w, ((1,), (1 if self.transpose_weight else 0,)), dtype)
        return z if bias is None else (z + bias).astype(dtype)

    def dh(self, dlogits, w):
        return self._dot(dlogits, w, ((1,), (0 if self.transpose_weight else 1,)), jnp.float32)

    def dw(self, h, dlogits, dtype):
        """The chunk's weight gradient in the weight's layout, in ``dtype``."""
        if self.transpose_weight:
            return self._dot(dlogits, h, ((0,), (0,)), dtype)
        return self._dot(h, dlogits, ((0,), (0,)), dtype)

    @classmethod
    def of(cls, fn, h, weight, bias, *, transpose_weight, chunk_size, precision, preferred):
        """h, the weight and the bias checked (errors name ``fn`` and the argument), the
        weight and bias marked varying like h, and the options (the default chunk from
        h's rows)."""
        h = float_array(fn, "h", h)
        weight = float_array(fn, "weight", weight)
        if not isinstance(transpose_weight, bool):
            raise TypeError(
                f"{fn}: transpose_weight must be a bool, got {type(transpose_weight).__name__}"
            )
        d = h.shape[-1]
        layout = "(V, d)" if transpose_weight else "(d, V)"
        if weight.ndim != 2 or weight.shape[1 if transpose_weight else 0] != d:
            raise ValueError(
                f"{fn}: weight must have shape {layout} with d = {d} (h's last axis)"
                f"{'' if transpose_weight else '; a (V, d) table needs transpose_weight=True'}, "
                f"got {weight.shape}"
            )
        if weight.dtype != h.dtype:
            raise TypeError(
                f"{fn}: weight must have h's dtype {h.dtype}, got {weight.dtype} "
                "(cast one of them first)"
            )
        vocab = weight.shape[0 if transpose_weight else 1]
        if bias is not None:
            bias = float_array(fn, "bias", bias)
            if bias.shape != (vocab,):
                raise ValueError(f"{fn}: bias must have shape ({vocab},), got {bias.shape}")
            if bias.dtype != weight.dtype:
                raise TypeError(
                    f"{fn}: bias must have the weight's dtype {weight.dtype}, got {bias.dtype}"
                )
        weight, bias = (varying_like(h, v) for v in (weight, bias))
        dtype = _logits_dtype(fn, preferred, h.dtype)
        tokens = math.prod(h.shape[:-1])
        if chunk_size is None:
            chunk_size = default_chunk(tokens, vocab, np.dtype(dtype).itemsize)
        elif isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
            raise TypeError(
                f"{fn}: chunk_size must be a positive int or None, got {type(chunk_size).__name__}"
            )
        elif chunk_size < 1:
            raise ValueError(f"{fn}: chunk_size must be positive, got {chunk_size}")
        linear = cls(transpose_weight, int(chunk_size), dtype, _precision(fn, precision))
        return h, weight, bias, linear


def default_chunk(tokens: int, vocab: int, itemsize: int) -> int:
    """The default ``chunk_size``: rows whose logits take at most ``CHUNK_BYTES`` (1 GiB),
    or ``CHUNK_MIN_ROWS`` (2048) rows where that is more, and at most
    ``CHUNK_FREE_FRACTION`` (1/8) of the default device's free memory where it reports
    it, a multiple of ``CHUNK_MULTIPLE`` (128) rows, at least that many, and no more
    than ``tokens``."""
    rows = _chunk_rows(vocab, itemsize, _free_bytes())
    return max(min(rows, tokens), min(CHUNK_MULTIPLE, tokens), 1)


def _chunk_rows(vocab: int, itemsize: int, free: int | None) -> int:
    """The default chunk's rows for ``free`` bytes of free memory (None: unknown), before
    the tokens bound them."""
    row_bytes = max(vocab * itemsize, 1)
    rows = max(CHUNK_BYTES // row_bytes, CHUNK_MIN_ROWS)
    if free is not None:
        rows = min(rows, int(free * CHUNK_FREE_FRACTION) // row_bytes)
    return rows // CHUNK_MULTIPLE * CHUNK_MULTIPLE


def slice_widths(vocab: int, count: int) -> tuple[int, ...]:
    """The widths of ``count`` slices of the vocabulary: equal, where they are a multiple
    of ALIGNED_VOCAB wide (or ``count`` is 1); else a multiple of SLICE_MULTIPLE wide but
    the last, as few as that width takes."""
    if count == 1 or (vocab % count == 0 and vocab // count % ALIGNED_VOCAB == 0):
        return (vocab // count,) * count
    width = -(-vocab // (count * SLICE_MULTIPLE)) * SLICE_MULTIPLE
    whole = -(-vocab // width) - 1
    return (width,) * whole + (vocab - whole * width,)


def default_slice_counts(vocab: int, itemsize: int) -> tuple[int, ...]:
    """The slice counts that per-row losses over ``vocab`` take with the default chunk
    (where the free memory does not shrink it) and logits of ``itemsize`` bytes: the
    powers of two up to the count of chunks that as many rows as ``vocab`` fill."""
    most = max(-(-vocab // _chunk_rows(vocab, itemsize, None)), 1)
    return tuple(1 << k for k in range((most - 1).bit_length() + 1))


def _free_bytes() -> int | None:
    """The default device's free memory, where it reports it."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def _precision(fn, precision):
    """``precision`` as lax.dot_general takes it, hashable."""
    if precision is None or isinstance(precision, lax.Precision):
        return precision
    if isinstance(precision, str) and precision.upper() in _PRECISIONS:
        return lax.Precision[precision.upper()]
    if isinstance(precision, tuple) and len(precision) == 2:
        return tuple(_precision(fn, p) for p in precision)
    raise ValueError(
        f"{fn}: precision must be None, a jax.lax.Precision, one of "
        f"{[p.lower() for p in _PRECISIONS]} or a pair of them, got {precision!r}"
    )


def _logits_dtype(fn, preferred, dtype):
    """The logits' dtype: h's, or ``preferred`` as JAX takes it (float64 is float32
    unless x64 is enabled)."""
    if preferred is None:
        return np.dtype(dtype).name
    try:
        name = np.dtype(preferred).name
    except TypeError:
        name = None
    if name not in ("float32", "bfloat16", "float16", "float64"):
        raise TypeError(
            f"{fn}: preferred_element_type must be None or a floating dtype "
            f"(float32, bfloat16, float16, float64), got {preferred!r}"
        )
    return jax.dtypes.canonicalize_dtype(name).name
