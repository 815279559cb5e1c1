"""The cross-entropy options, checked once from the public arguments and carried by name
to the primitives, the XLA formulation and the kernels; and the labels, checked."""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import static_float

REDUCTIONS = ("none", "sum", "mean")
_INT32 = np.iinfo(np.int32)


@dataclasses.dataclass(frozen=True)
class CrossEntropyOptions:
    """The options of a cross-entropy over z = softcap(logits) / temperature, with the
    public arguments' names (``logit_softcap`` None: no softcap)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    logit_softcap: float | None = None
    temperature: float = 1.0

    @classmethod
    def of(
        cls, fn: str, *, ignore_index, label_smoothing, z_loss, logit_softcap, temperature
    ) -> CrossEntropyOptions:
        """The options of a call of ``fn``, or a TypeError or ValueError that names the
        argument."""
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
            raise TypeError(
                f"{fn}: ignore_index must be a Python int, got {type(ignore_index).__name__}"
            )
        if not _INT32.min <= ignore_index <= _INT32.max:
            raise ValueError(f"{fn}: ignore_index must fit in int32, got {ignore_index}")
        label_smoothing = static_float(fn, "label_smoothing", label_smoothing, low=0.0, high=1.0)
        z_loss = static_float(fn, "z_loss", z_loss, low=0.0)
        if logit_softcap is not None:
            logit_softcap = static_float(fn, "logit_softcap", logit_softcap, positive=True)
        temperature = static_float(fn, "temperature", temperature, positive=True)
        # the kernels take 1 / temperature, which must be a finite float32
        if temperature < 1.0 / float(np.finfo(np.float32).max):
            raise ValueError(f"{fn}: temperature must be at least 3e-38, got {temperature}")
        return cls(int(ignore_index), label_smoothing, z_loss, logit_softcap, temperature)


def checked_reduction(fn: str, reduction, return_lse) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    checked_bool(fn, "return_lse", return_lse)


def checked_bool(fn: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__}")


def labels_of(fn: str, labels, shape) -> jax.Array:
    """``labels`` as int32 of the logits' leading shape; values beyond int32 are clipped
    (they stay out of range)."""
    if not (hasattr(labels, "shape") and hasattr(labels, "dtype")):
        raise TypeError(
            f"{fn}: labels must be an integer array (jax.Array or numpy.ndarray), "
            f"got {type(labels).__name__}"
        )
    dtype = np.dtype(labels.dtype)
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{fn}: labels must have an integer dtype (any width), got {dtype.name}")
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(
            f"{fn}: labels must have the logits' leading shape {tuple(shape)}, "
            f"got {tuple(labels.shape)}"
        )
    labels = jnp.asarray(labels)
    if dtype.itemsize >= 4 and dtype != np.int32:
        if np.issubdtype(dtype, np.unsignedinteger):
            labels = jnp.minimum(labels, _INT32.max)
        else:
            labels = jnp.clip(labels, _INT32.min, _INT32.max)
    return labels.astype(jnp.int32)


def logprob_options(fn, shape, labels, *, temperature, return_entropy, logit_softcap, ignore_index):
    """The checked labels (int32 of the leading ``shape``) and options of a token_logprobs
    over rows of ``shape[-1]``. With ``ignore_index`` None no row is ignored: negative
    labels (out of range anyway) go to V, and -1 is the ignore_index, which then matches
    none."""
    labels = labels_of(fn, labels, shape[:-1])
    if ignore_index is None:
        labels = jnp.where(labels < 0, shape[-1], labels)
        ignore_index = -1
    checked_bool(fn, "return_entropy", return_entropy)
    options = CrossEntropyOptions.of(
        fn,
        ignore_index=ignore_index,
        label_smoothing=0.0,
        z_loss=0.0,
        logit_softcap=logit_softcap,
        temperature=temperature,
    )
    return labels, options
