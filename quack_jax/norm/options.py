"""The norms' options, checked once from the public arguments and carried by name to the
primitives and the kernels."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np

from .._checks import static_float

OUT_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class NormOptions:
    """RMSNorm (``rms``) or LayerNorm, with the public arguments' names; ``out_dtype`` is
    the result's dtype name."""

    rms: bool
    eps: float
    weight_offset: float
    out_dtype: str
    prenorm: bool

    @classmethod
    def of(cls, fn: str, rms: bool, x, *, eps, weight_offset, out_dtype, prenorm, has_weight):
        """The options of a call of ``fn`` on ``x``, or a TypeError or ValueError that
        names the argument."""
        eps = static_float(fn, "eps", eps, positive=True)
        weight_offset = static_float(fn, "weight_offset", weight_offset)
        if weight_offset and not has_weight:
            raise ValueError(f"{fn}: weight_offset={weight_offset} needs a weight")
        if not isinstance(prenorm, bool):
            raise TypeError(f"{fn}: prenorm must be a bool, got {type(prenorm).__name__}")
        return cls(rms, eps, weight_offset, _out_dtype(fn, x, out_dtype), prenorm)


def _out_dtype(fn: str, x, out_dtype) -> str:
    if out_dtype is None:
        return x.dtype.name
    try:
        out = np.dtype(out_dtype)
    except TypeError:
        raise TypeError(f"{fn}: out_dtype must be a dtype, got {out_dtype!r}") from None
    if out.name not in OUT_DTYPES:
        raise TypeError(
            f"{fn}: out_dtype must be float32, bfloat16, float16 or float64, got {out.name}"
        )
    # as JAX takes a requested dtype: float64 is float32 unless x64 is enabled
    canonical = np.dtype(jax.dtypes.canonicalize_dtype(out))
    if canonical != out:
        warnings.warn(
            f"Explicitly requested dtype {out.name} requested in {fn} is not available, "
            f"and will be truncated to dtype {canonical.name}. To enable more dtypes, set "
            "the jax_enable_x64 configuration option or the JAX_ENABLE_X64 shell "
            "environment variable.",
            stacklevel=5,
        )
    return canonical.name
