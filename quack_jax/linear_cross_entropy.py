"""Linear + cross-entropy without the logits: ``cross_entropy(h @ W + bias, labels)`` in
chunks of rows.

The (tokens, vocabulary) logits never exist whole. For each chunk of rows XLA's GEMM
makes the chunk's logits, and the cross-entropy kernel that writes the gradient writes it
over them (an aliased output, so the chunk has one (rows, V) buffer); two more GEMMs give
the chunk's rows of dh and add its share of dW (and of the bias gradient) to float32
accumulators. A "sum" or "mean" loss has its gradients at the end of the forward pass,
and ``custom_vjp`` scales them by the cotangent. Per-row losses (or lse) keep the row
statistics (shift, logsum; see ``cross_entropy``), and the backward makes each chunk's
logits again and runs the backward kernel over them in place. Only the gradients that
autodiff asks for are made (``symbolic_zeros``).

Under a sharded ``jit`` the op partitions itself (``custom_partitioning``): each device
runs the chunks of its own rows, and dW is summed over the devices that split the rows
at the end (one ``psum``). With the weight's vocabulary axis split (a tensor-parallel LM
head), each chunk combines its per-row statistics across the devices as
``cross_entropy`` does, and its dh is summed over them. Off the GPU the same chunks run
through the XLA reference, so the memory saving holds everywhere. Why chunks of this
size, equal and overlapping, with a float32 dW: docs/decisions/017-linear-cross-entropy-chunks.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from ._checks import float_array
from ._implementation import use_xla
from ._jax_private import new_primitive
from ._partition import (
    STAT,
    WHOLE,
    Row,
    count,
    dims_spec,
    in_auto_axes,
    names,
    role_aval,
    varying_like,
)
from ._primitive import compute_dtype
from ._spec import OpSpec, Shapes
from .cross_entropy import (
    _backward_split,
    _coefficients,
    _forward_split,
    _reduce,
    _row_weights,
    finish,
    labels_of,
    logprob_options,
    logprob_outputs,
    options,
    token_logprobs,
    xla_formulation,
)

# the default chunk: rows whose logits take at most this many bytes, and at most this
# fraction of the free device memory, a multiple of CHUNK_MULTIPLE rows: large enough
# that each chunk's GEMMs run near the whole-T GEMMs' speed, small next to XLA's whole
# logits (docs/decisions/017-linear-cross-entropy-chunks.md)
CHUNK_BYTES = 1 << 30
CHUNK_FREE_FRACTION = 1 / 8
CHUNK_MULTIPLE = 128
# the per-row results of the forward: the loss and the row statistics (cross_entropy.py),
# and with ``entropy`` the rows' entropy (linear_token_logprobs)
_STATS = ("loss", "shift", "logsum")


def _stats(entropy: bool) -> tuple[str, ...]:
    return _STATS + ("entropy",) * entropy


@dataclasses.dataclass(frozen=True)
class Linear:
    """How a chunk's logits are made from its rows ``h`` (rows, d): ``h @ W`` with W of
    shape (d, V), or (V, d) with ``transpose``, plus an optional bias; ``chunk`` rows at a
    time, GEMMs at ``precision``, logits of ``dtype``. The backward GEMMs take dlogits
    in h's dtype and accumulate in float32."""

    transpose: bool
    chunk: int
    dtype: str
    precision: Any = None

    def _dot(self, a, b, contract, dtype):
        return lax.dot_general(
            a, b, (contract, ((), ())), precision=self.precision, preferred_element_type=dtype
        )

    def logits(self, h, w, bias):
        z = self._dot(h, w, ((1,), (1 if self.transpose else 0,)), self.dtype)
        return z if bias is None else (z + bias).astype(self.dtype)

    def dh(self, dlogits, w):
        return self._dot(dlogits, w, ((1,), (0 if self.transpose else 1,)), jnp.float32)

    def dw(self, h, dlogits):
        """The chunk's weight gradient in the weight's layout."""
        if self.transpose:
            return self._dot(dlogits, h, ((0,), (0,)), jnp.float32)
        return self._dot(h, dlogits, ((0,), (0,)), jnp.float32)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Needs:
    """Which gradients autodiff asks for: of h, of the weight, of the bias."""

    h: bool
    weight: bool
    bias: bool


def _unpack(operands, has_bias):
    """(h, weight, bias or None, labels, [per-row operands])."""
    h, w, *rest = operands
    bias = rest.pop(0) if has_bias else None
    return h, w, bias, rest[0], rest[1:]


def _gradient_names(mode, needs):
    if mode == "loss":
        return ()
    return tuple(
        k for k, on in zip(("dh", "dw", "db"), dataclasses.astuple(needs), strict=True) if on
    )


# -- the chunked computation on one device's block --------------------------------------


def _local(*operands, mode, needs, has_bias, linear, ce, entropy, row=WHOLE, data_axes=()):
    """The op on operands whose rows (and, with ``row``, vocabulary slice) are this
    device's; ``data_axes`` are the mesh axes that split the rows, over which dW and the
    bias gradient are summed. Results: [loss, shift, logsum] (the row statistics, see
    cross_entropy.py) and with ``entropy`` the rows' entropy (not in "backward"), then the
    gradients in ``needs``: dh (h's dtype), dW and db (float32)."""
    h, w, bias, labels, per_row = _unpack(operands, has_bias)
    lead, d = labels.shape, h.shape[-1]
    h, labels = h.reshape(-1, d), labels.reshape(-1)
    per_row = [p.reshape(-1) for p in per_row]
    t, stat = h.shape[0], compute_dtype(linear.dtype)
    ignore_index, smoothing, z_loss, softcap, temperature = ce
    grads = _gradient_names(mode, needs)
    vocab = w.shape[0 if linear.transpose else 1]
    stats = _stats(entropy)
    shapes = {k: ((t,), stat) for k in stats} | {"dh": ((t, d), h.dtype)}
    shapes |= {"dw": (w.shape, jnp.float32), "db": ((vocab,), jnp.float32)}
    # zeros that vary over shard_map's axes as the chunks' results do; dW and db are
    # written by the first chunk
    results = stats * (mode != "backward") + ("dh",) * ("dh" in grads)
    carry = {k: varying_like(h, jnp.zeros(*shapes[k])) for k in results}

    # ceil(t / chunk) chunks of equal size; when that size does not divide t, the last
    # chunk ends at row t and overlaps the one before it: its rows already done get zero
    # gradient coefficients, and their dh is kept
    chunks = -(-t // linear.chunk)
    size = -(-t // chunks) if t else 0

    def step(i, carry):
        start = jnp.minimum(i * size, t - size)
        fresh = start + jnp.arange(size) >= i * size

        def rows(a):
            return lax.dynamic_slice_in_dim(a, start, size)

        hc = rows(h)
        logits = linear.logits(hc, w, bias)
        # the per-row gradient coefficients: the weights in "grad"; a, b, c after the
        # statistics in "backward"
        kept = 2 if mode == "backward" else 0
        coefficients = [jnp.where(fresh, rows(p), 0) for p in per_row[kept:]]
        inputs = (logits, rows(labels), *map(rows, per_row[:kept]), *coefficients)
        if mode == "backward":
            (dlogits,) = _backward_split(
                row, softcap=softcap, temperature=temperature, entropy=entropy, inplace=True
            )(*inputs)
        else:
            outs = _forward_split(
                row,
                ignore_index=ignore_index,
                smoothing=smoothing,
                z_loss=z_loss,
                softcap=softcap,
                temperature=temperature,
                entropy=entropy,
                grad=mode == "grad",
                inplace=mode == "grad",
            )(*inputs)
            carry = dict(carry)
            for k, v in zip(stats, outs, strict=False):
                carry[k] = lax.dynamic_update_slice_in_dim(carry[k], v.astype(stat), start, 0)
            if not grads:
                return carry
            (dlogits,) = outs[len(stats) :]
        dlogits = dlogits.astype(h.dtype)
        carry = dict(carry)
        if "dh" in grads:
            dh = linear.dh(dlogits, w)
            dh = jax.lax.psum(dh, row.axes) if row.axes else dh
            dh = jnp.where(fresh[:, None], dh.astype(h.dtype), rows(carry["dh"]))
            carry["dh"] = lax.dynamic_update_slice_in_dim(carry["dh"], dh, start, 0)
        sums = {}
        if "dw" in grads:
            sums["dw"] = linear.dw(hc, dlogits)
        if "db" in grads:
            sums["db"] = jnp.sum(dlogits, axis=0, dtype=jnp.float32)
        # the first chunk writes dW and db, the others add to them
        return carry | {k: carry[k] + v if k in carry else v for k, v in sums.items()}

    if size:
        carry = lax.fori_loop(1, chunks, step, step(0, carry))
    else:
        carry |= {k: varying_like(h, jnp.zeros(*shapes[k])) for k in grads if k not in carry}
    for k in ("dw", "db"):
        if k in carry and data_axes:
            carry[k] = jax.lax.psum(carry[k], data_axes)
    outs = [] if mode == "backward" else [carry[k].reshape(lead) for k in stats]
    for k in grads:
        outs.append(carry[k].reshape(*lead, d) if k == "dh" else carry[k])
    return outs


# -- partitioning: rows over some mesh axes, the vocabulary over others ------------------


def _factors(mode, needs, has_bias, entropy, transpose, lead_rank, n_per_row):
    """The Shardy factors of each operand and result: b0.. for the rows, d, v."""
    rows = tuple(f"b{i}" for i in range(lead_rank))
    weight = ("v", "d") if transpose else ("d", "v")
    ins = [(*rows, "d"), weight] + [("v",)] * has_bias + [rows] * (1 + n_per_row)
    grad = {"dh": (*rows, "d"), "dw": weight, "db": ("v",)}
    outs = [] if mode == "backward" else [rows] * len(_stats(entropy))
    return ins, outs + [grad[k] for k in _gradient_names(mode, needs)]


def _partitioned(params, avals_in, avals_out):
    """A function of the operands that computes the op and that XLA partitions along the
    rows of h and along the weight's vocabulary axis."""
    whole = functools.partial(_local, **params)
    lead_rank = avals_in[0].ndim - 1
    if lead_rank == 0:  # a single row: nothing to split
        return whole
    transpose = params["linear"].transpose
    n_per_row = len(avals_in) - 3 - params["has_bias"]
    flags = (params[k] for k in ("mode", "needs", "has_bias", "entropy"))
    ins, outs = _factors(*flags, transpose, lead_rank, n_per_row)

    @custom_partitioning
    def op(*operands):
        return tuple(whole(*operands))

    def shardings(mesh, arg_shapes):
        *lead, _ = dims_spec(mesh, arg_shapes[0].sharding, arg_shapes[0])
        vocab = dims_spec(mesh, arg_shapes[1].sharding, arg_shapes[1])[0 if transpose else 1]
        taken = {a for axes in lead for a in names(axes)}
        if set(names(vocab)) & taken:  # a mesh axis splits the rows or the vocabulary
            vocab = None
        axes = {f"b{i}": a for i, a in enumerate(lead)} | {"d": None, "v": vocab}

        def sharding(factors):
            return NamedSharding(mesh, PartitionSpec(*(axes[f] for f in factors)))

        return lead, vocab, [sharding(f) for f in ins], [sharding(f) for f in outs]

    def infer(mesh, arg_shapes, result_shape):
        return tuple(shardings(mesh, arg_shapes)[3])

    def partition(mesh, arg_shapes, result_shape):
        lead, vocab, arg_shardings, out_shardings = shardings(mesh, arg_shapes)
        row = Row(names(vocab), count(mesh, vocab)) if vocab else WHOLE
        data = tuple(a for axes in lead for a in names(axes))
        local = functools.partial(_local, **params, row=row, data_axes=data)
        return mesh, lambda *ops: tuple(local(*ops)), tuple(out_shardings), tuple(arg_shardings)

    produced = {f for factors in outs for f in factors}
    op.def_partition(
        partition,
        infer_sharding_from_operands=infer,
        sharding_rule=" -> ".join(", ".join(" ".join(f) for f in side) for side in (ins, outs)),
        reduction_factors=tuple(f for f in dict.fromkeys(sum(ins, ())) if f not in produced),
    )
    return in_auto_axes(op, avals_in, avals_out)


# -- the primitive ---------------------------------------------------------------------


def _abstract(*avals, mode, needs, has_bias, linear, ce, entropy):
    h, w, bias, _, _ = _unpack(avals, has_bias)
    stat = role_aval(h, STAT, compute_dtype(linear.dtype))
    grad = {
        "dh": h.update(weak_type=False),
        "dw": w.update(dtype=np.dtype("float32"), weak_type=False),
    }
    if bias is not None:
        grad["db"] = bias.update(dtype=np.dtype("float32"), weak_type=False)
    outs = [] if mode == "backward" else [stat] * len(_stats(entropy))
    return outs + [grad[k] for k in _gradient_names(mode, needs)]


def _batch(operands, dims, *, mode, needs, has_bias, **params):
    """A batch of token rows becomes a leading row axis. Per-example weight gradients,
    or a batched weight or bias, run the examples one after another (``lax.map``)."""
    size = next(x.shape[d] for x, d in zip(operands, dims, strict=True) if d is not None)
    params = dict(mode=mode, needs=needs, has_bias=has_bias, **params)
    shared = range(1, 2 + has_bias)  # the weight and the bias

    def leading(x, d):
        return jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)

    if any(dims[i] is not None for i in shared) or (
        mode != "loss" and (needs.weight or needs.bias)
    ):
        ops = [leading(x, d) for x, d in zip(operands, dims, strict=True)]
        outs = lax.map(lambda ops: tuple(_primitive.bind(*ops, **params)), ops)
    else:
        ops = [
            x if i in shared else leading(x, d)
            for i, (x, d) in enumerate(zip(operands, dims, strict=True))
        ]
        outs = _primitive.bind(*ops, **params)
    return list(outs), [0] * len(outs)


def _lower(ctx, *operands, **params):
    fn = _partitioned(params, ctx.avals_in, ctx.avals_out)
    return mlir.lower_fun(lambda *ops: list(fn(*ops)), multiple_results=True)(ctx, *operands)


_primitive = new_primitive("quack_jax_linear_cross_entropy")
_primitive.def_abstract_eval(_abstract)
batching.primitive_batchers[_primitive] = _batch
mlir.register_lowering(_primitive, _lower)


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static arguments: the cross-entropy options, the linear map, the reduction,
    the dtypes the gradients are returned in, and whether the rows' entropy is made
    (linear_token_logprobs)."""

    ce: tuple
    linear: Linear
    reduction: str
    weight_dtype: str
    bias_dtype: str | None
    entropy: bool = False


def _bind(cfg: _Config, mode, needs, h, w, bias, labels, *per_row):
    operands = (h, w) + ((bias,) if bias is not None else ()) + (labels, *per_row)
    return _primitive.bind(
        *operands,
        mode=mode,
        needs=needs,
        has_bias=bias is not None,
        linear=cfg.linear,
        ce=cfg.ce,
        entropy=cfg.entropy and mode != "grad",
    )


def _gradients(cfg: _Config, needs, grads, scale=None):
    """The cotangents of (h, weight, bias, labels) from the gradients ``needs`` made,
    times ``scale``, in their arguments' dtypes."""
    grads = iter(grads)
    out = []
    for on, dtype in zip(
        dataclasses.astuple(needs), (None, cfg.weight_dtype, cfg.bias_dtype), strict=True
    ):
        g = next(grads) if on else None
        if g is not None:
            dtype = dtype or g.dtype
            g = (g if scale is None else g * scale).astype(dtype)
        out.append(g)
    return (*out, None)


def _needs(h, w, bias) -> Needs:
    return Needs(h.perturbed, w.perturbed, bias is not None and bias.perturbed)


def _values(*primals):
    return [None if p is None else p.value for p in primals]


# "sum" or "mean" alone: the gradients come from the forward pass


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reduced(cfg: _Config, h, w, bias, labels):
    loss, *_ = _bind(cfg, "loss", Needs(False, False, False), h, w, bias, labels)
    return _reduce(loss, labels, cfg.ce[0], cfg.reduction == "mean")


def _reduced_forward(cfg: _Config, h, w, bias, labels):
    needs = _needs(h, w, bias)
    h, w, bias, labels = _values(h, w, bias, labels)
    weights = _row_weights(labels, cfg.ce[0], cfg.reduction == "mean")
    loss, _, _, *grads = _bind(cfg, "grad", needs, h, w, bias, labels, weights)
    return _reduce(loss, labels, cfg.ce[0], cfg.reduction == "mean"), (needs, grads)


def _reduced_backward(cfg: _Config, saved, g):
    needs, grads = saved
    return _gradients(cfg, needs, grads, g)


_reduced.defvjp(_reduced_forward, _reduced_backward, symbolic_zeros=True)


# per-row losses (or lse): the backward makes each chunk's logits again


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _per_row(cfg: _Config, h, w, bias, labels):
    """The rows' loss and lse, and with ``cfg.entropy`` their entropy."""
    loss, shift, logsum, *ent = _bind(cfg, "loss", Needs(False, False, False), h, w, bias, labels)
    return (loss, shift + logsum, *ent)


def _per_row_forward(cfg: _Config, h, w, bias, labels):
    needs = _needs(h, w, bias)
    h, w, bias, labels = _values(h, w, bias, labels)
    loss, shift, logsum, *ent = _bind(cfg, "loss", needs, h, w, bias, labels)
    return (loss, shift + logsum, *ent), (needs, h, w, bias, labels, shift, logsum, ent)


def _dense(cotangent, like):
    if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
        return jnp.zeros(like.shape, like.dtype)
    return cotangent


def _per_row_backward(cfg: _Config, saved, cotangents):
    needs, h, w, bias, labels, shift, logsum, ent = saved
    lse = shift + logsum
    g_loss, g_lse, *g_ent = (_dense(c, lse) for c in cotangents)
    v = w.shape[0 if cfg.linear.transpose else 1]
    ignore_index, smoothing, z_loss, *_ = cfg.ce
    terms = (g_ent[0], logsum, ent[0]) if cfg.entropy else None
    args = (labels, v, ignore_index, smoothing, z_loss, lse, g_loss, g_lse, terms)
    coefficients = _coefficients(*args)
    grads = _bind(cfg, "backward", needs, h, w, bias, labels, shift, logsum, *coefficients)
    return _gradients(cfg, needs, grads)


_per_row.defvjp(_per_row_forward, _per_row_backward, symbolic_zeros=True)


# -- the public function -------------------------------------------------------------


def default_chunk(tokens: int, vocab: int, itemsize: int) -> int:
    """The default ``chunk_size``: rows whose logits take at most ``CHUNK_BYTES`` (1 GiB)
    and at most ``CHUNK_FREE_FRACTION`` (1/8) of the default device's free memory where
    it reports it, a multiple of ``CHUNK_MULTIPLE`` (128) rows, at least that many, and
    no more than ``tokens``."""
    budget = CHUNK_BYTES
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        budget = min(budget, int(free * CHUNK_FREE_FRACTION))
    rows = budget // max(vocab * itemsize, 1) // CHUNK_MULTIPLE * CHUNK_MULTIPLE
    return max(min(rows, tokens), min(CHUNK_MULTIPLE, tokens), 1)


_PRECISIONS = tuple(p.name for p in lax.Precision)


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


def linear_cross_entropy(
    h: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    transpose_weight: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcap: float | None = None,
    temperature: float = 1.0,
    return_lse: bool = False,
    chunk_size: int | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    implementation: str | None = None,
):
    """``cross_entropy(h @ weight + bias, labels, ...)`` without making the logits.

    The rows of ``h`` go in chunks of at most ``chunk_size``: each chunk's logits are made by
    XLA's GEMM, and the cross-entropy kernel writes their gradient over them in place;
    the weight gradient accumulates in float32. A "sum" or "mean" loss computes its
    gradients in the forward pass; per-row losses recompute each chunk's logits in the
    backward. Results and gradients are those of ``cross_entropy`` of the full logits.

    Args:
      h: array (..., d), float32, bfloat16 or float16 (float64 runs the XLA reference).
      weight: the LM head, (d, V) as a Flax ``Dense`` kernel, or (V, d) with
        ``transpose_weight`` (a tied embedding table, used without a transposed copy);
        h's dtype.
      labels: integer array of shape ``h.shape[:-1]``.
      bias: None, or (V,) of the weight's dtype, added to the logits.
      transpose_weight: whether ``weight`` is (V, d).
      ignore_index, reduction, label_smoothing, z_loss: as in
        :func:`quack_jax.cross_entropy`.
      logit_softcap, temperature, return_lse: as in :func:`quack_jax.cross_entropy`.
      chunk_size: the most rows per chunk, a positive int; by default (None) the rows
        whose logits take at most 1 GiB and 1/8 of the free device memory (see
        ``default_chunk``). The rows go in ceil(T / chunk_size) chunks of equal size;
        where that size does not divide T, the last chunk ends at row T and overlaps
        the one before it (its rows done before get no second gradient).
      precision: of the three GEMMs, as in ``jax.lax.dot_general``.
      preferred_element_type: the logits' dtype (default: h's). The backward GEMMs take
        dlogits in h's dtype.
      implementation: None, or "xla": the whole logits ``h @ weight + bias`` made by
        XLA and :func:`quack_jax.cross_entropy`'s XLA formulation on them, differentiated
        by JAX (no chunks, no quack_jax primitive: to bisect a numerics difference). None
        follows ``$QUACK_JAX_IMPLEMENTATION``, read at trace time.

    Returns:
      the loss in float32 (float64 for float64 logits): a scalar for "sum" and "mean",
      of ``labels``' shape for "none"; with ``return_lse`` the tuple ``(loss, lse)``.
    """
    fn = "linear_cross_entropy"
    h, weight, bias, linear = _checked(
        fn, h, weight, bias, transpose_weight, chunk_size, precision, preferred_element_type
    )
    labels = labels_of(fn, labels, h.shape[:-1])
    ce = options(
        fn, ignore_index, reduction, label_smoothing, z_loss, logit_softcap, return_lse, temperature
    )
    bias_dtype = None if bias is None else bias.dtype.name
    cfg = _Config(ce, linear, reduction, weight.dtype.name, bias_dtype)
    if use_xla(fn, implementation):
        return xla_formulation(_logits(h, weight, bias, linear), labels, ce, reduction, return_lse)
    if reduction != "none" and not return_lse:
        return _reduced(cfg, h, weight, bias, labels)
    loss, lse = _per_row(cfg, h, weight, bias, labels)
    return finish(loss, lse, labels, ce, reduction, return_lse)


def linear_token_logprobs(
    h: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    transpose_weight: bool = False,
    temperature: float = 1.0,
    return_entropy: bool = False,
    logit_softcap: float | None = None,
    ignore_index: int | None = None,
    chunk_size: int | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    implementation: str | None = None,
):
    """``token_logprobs(h @ weight + bias, labels, ...)`` without making the logits: the
    log-probability of each row's label at ``temperature``, and with ``return_entropy``
    the entropy, in the chunks of :func:`linear_cross_entropy` (whose per-row path it
    takes: under ``jax.grad`` the backward makes each chunk's logits again and runs the
    backward kernel over them for the cotangents of both outputs).

    Args:
      h, weight, labels, bias, transpose_weight: as in :func:`linear_cross_entropy`.
      chunk_size, precision, preferred_element_type: as in :func:`linear_cross_entropy`.
      temperature, return_entropy, logit_softcap, ignore_index: as in
        :func:`quack_jax.token_logprobs`.
      implementation: None, or "xla": the whole logits made by XLA and
        :func:`quack_jax.token_logprobs`' XLA formulation on them.

    Returns:
      logp, float32 of ``labels``' shape, and with ``return_entropy`` the tuple
      ``(logp, entropy)``.
    """
    fn = "linear_token_logprobs"
    h, weight, bias, linear = _checked(
        fn, h, weight, bias, transpose_weight, chunk_size, precision, preferred_element_type
    )
    vocab = weight.shape[0 if transpose_weight else 1]
    shape = (*h.shape[:-1], vocab)
    labels, ce = logprob_options(
        fn, shape, labels, temperature, return_entropy, logit_softcap, ignore_index
    )
    if use_xla(fn, implementation):
        options = dict(temperature=ce[4], logit_softcap=ce[3], ignore_index=ce[0])
        logits = _logits(h, weight, bias, linear)
        return token_logprobs(
            logits, labels, return_entropy=return_entropy, implementation="xla", **options
        )
    bias_dtype = None if bias is None else bias.dtype.name
    cfg = _Config(ce, linear, "none", weight.dtype.name, bias_dtype, return_entropy)
    loss, _, *ent = _per_row(cfg, h, weight, bias, labels)
    return logprob_outputs(loss, ent, labels, ce)


def _logits(h, weight, bias, linear):
    """The whole logits ``h @ weight + bias``, made by XLA (``implementation="xla"``)."""
    d, vocab = h.shape[-1], weight.shape[0 if linear.transpose else 1]
    return linear.logits(h.reshape(-1, d), weight, bias).reshape(*h.shape[:-1], vocab)


def _checked(fn, h, weight, bias, transpose_weight, chunk_size, precision, preferred):
    """h, the weight and the bias checked (errors name ``fn`` and the argument), the
    weight and bias marked varying like h, and the linear map (the default chunk from
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
    linear = Linear(transpose_weight, int(chunk_size), dtype, _precision(fn, precision))
    return h, weight, bias, linear


def _lowerings(op: str, dtype: str, n: int, packaged: bool):
    """The value and gradients over two whole chunks and a part, with the weight as
    (d, V) and as (V, d) (``packaged``: (d, V) only): of the mean loss, or of the sum of
    logp and the entropy (linear_token_logprobs)."""
    t, d, chunk = 300, 64, 128
    h, labels = jax.ShapeDtypeStruct((t, d), dtype), jax.ShapeDtypeStruct((t,), "int32")
    for transpose in (False,) if packaged else (False, True):
        w = jax.ShapeDtypeStruct((n, d) if transpose else (d, n), dtype)

        def loss(h, w, labels, transpose=transpose):
            def f(h, w):
                options = dict(transpose_weight=transpose, chunk_size=chunk)
                if op == "linear_cross_entropy":
                    return linear_cross_entropy(h, w, labels, **options)
                logp, ent = linear_token_logprobs(h, w, labels, return_entropy=True, **options)
                return jnp.sum(logp + ent)

            return jax.value_and_grad(f, argnums=(0, 1))(h, w)

        yield loss, (h, w, labels)


SPEC = OpSpec(
    ops=("linear_cross_entropy", "linear_token_logprobs"),
    configs=(),  # the cross-entropy kernels
    sizes="vocab",
    lowerings=_lowerings,
    tests={
        "cpu": Shapes(rows=(300,), sizes=(1000,), dtypes=("float32", "bfloat16")),
        "gpu": Shapes(
            rows=(300,),
            sizes=(32000, 50257, 128256, 152064, 256000),
            dtypes=("bfloat16", "float32"),
        ),
    },
)
