"""``softmax_cross_entropy_with_integer_labels``: optax's function of that name on the
cross-entropy kernels, with optax's label handling, ``where`` and class axes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .._checks import axis_index, float_array
from .._primitive import compute_dtype
from .api import cross_entropy
from .options import labels_of


def _class_axes(fn: str, axis, ndim: int) -> tuple[int, ...]:
    """``axis`` (an int, or a tuple of ints as optax takes it) as axes in [0, ndim), in
    the order given: the order in which a label indexes the flattened class axes."""
    allowed = "an int or a tuple of ints"
    if not isinstance(axis, tuple):
        return (axis_index(fn, axis, ndim, allowed),)
    axes = tuple(axis_index(fn, a, ndim, allowed) for a in axis)
    if len(set(axes)) < len(axes):
        raise ValueError(f"{fn}: axis must name each axis once, got {axis}")
    return axes


def softmax_cross_entropy_with_integer_labels(
    logits: jax.Array,
    labels: jax.Array,
    axis: int | tuple[int, ...] = -1,
    where: jax.Array | None = None,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """``optax.softmax_cross_entropy_with_integer_labels`` on quack_jax's kernels.

    The same per-example loss ``logsumexp(logits) - logits[label]`` (no ignore index, no
    reduction) in the logits' dtype (computed in float32), the same label handling (a
    label in [-V, 0) counts from the end, as ``jnp.take_along_axis`` does; any other
    label outside [0, V) gives NaN) and the same ``where``: of the labels' shape, it sets
    the loss of rows where it is False to 0; of the logits' shape, it masks logits out of
    the logsumexp (that case runs optax's XLA formulation). ``axis`` is the class axis,
    or a tuple of them: their V elements are the classes, a label a flat (C-order) index
    into them in the order given, and the labels have the shape of the other axes. The
    kernels take the class axes last, merged into one, so other axes cost a transpose.
    ``implementation`` as in :func:`cross_entropy`.
    """
    fn = "softmax_cross_entropy_with_integer_labels"
    logits = float_array(fn, "logits", logits)
    shape = logits.shape
    axes = _class_axes(fn, axis, logits.ndim)
    batch = tuple(a for a in range(logits.ndim) if a not in axes)
    lead = tuple(shape[a] for a in batch)
    n = math.prod(shape[a] for a in axes)

    def rows(a):
        """``a`` of the logits' shape with the class axes last, merged into one."""
        return jnp.transpose(a, batch + axes).reshape(*lead, n)

    logits = rows(logits)
    labels = labels_of(fn, labels, lead)
    if where is not None and jnp.ndim(where) == len(shape):
        where = rows(jnp.broadcast_to(where, shape))
        lse = jax.nn.logsumexp(logits.astype(compute_dtype(logits.dtype)), axis=-1, where=where)
        target = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return jnp.where(jnp.any(where, axis=-1), lse - target, 0.0).astype(logits.dtype)
    wrapped = jnp.where(labels < 0, labels + n, labels)
    wrapped = jnp.where((wrapped < 0) | (wrapped >= n), n, wrapped)
    loss = cross_entropy(
        logits, wrapped, ignore_index=-1, reduction="none", implementation=implementation
    )
    if where is not None:
        if jnp.shape(where) != labels.shape:
            raise ValueError(
                f"{fn}: where must have the labels' shape {labels.shape} or the logits' "
                f"shape, got {jnp.shape(where)}"
            )
        loss = jnp.where(where, loss, 0.0)
    return loss.astype(logits.dtype)
