"""The derivative primitive: linear in its first operand t, reading the saved operand s
(y for softmax, x for log-softmax); its transpose is the derivative of the transposed
kind."""

from __future__ import annotations

from jax.interpreters import ad

from .._primitive import RowwisePrimitive, kernel_call, row_tiling
from .config import SoftmaxDerivative
from .reference import reference_derivative
from .rules import derivative_on_xla
from .tilings import SOFTMAX_BWD

_TRANSPOSED = {"softmax": "softmax", "log_vjp": "log_jvp", "log_jvp": "log_vjp"}


def _kernel(target, avals_in, avals_out, *, kind):
    tiling = row_tiling(avals_in[0], SOFTMAX_BWD)
    config = SoftmaxDerivative(kind=kind)
    return tiling and kernel_call(target, config, avals_in[0], tiling, avals_out)


def _transpose(cts, t, s, *, kind):
    (ct,) = cts
    assert ad.is_undefined_primal(t) and not ad.is_undefined_primal(s)
    if type(ct) is ad.Zero:
        return [None, None]
    return [derivative.bind(ct, s, kind=_TRANSPOSED[kind])[0], None]


derivative = RowwisePrimitive(
    "quack_jax_softmax_derivative",
    kernel=_kernel,
    prefers_reference=derivative_on_xla,
    reference=reference_derivative,
    transpose=_transpose,
)
