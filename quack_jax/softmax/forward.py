"""The forward primitive: y from x. Its JVP binds the forward and the derivative
primitive, which reads y (softmax) or x (log-softmax)."""

from __future__ import annotations

from jax.interpreters import ad

from .._primitive import RowwisePrimitive, kernel_call, row_tiling
from .config import Softmax
from .derivative import derivative
from .reference import reference_forward
from .rules import forward_on_xla
from .tilings import SOFTMAX_FWD


def _kernel(target, avals_in, avals_out, *, log):
    tiling = row_tiling(avals_in[0], SOFTMAX_FWD)
    return tiling and kernel_call(target, Softmax(log=log), avals_in[0], tiling, avals_out)


def _jvp(primals, tangents, *, log):
    (x,), (x_dot,) = primals, tangents
    y = forward.bind(x, log=log)
    kind, saved = ("log_jvp", x) if log else ("softmax", y[0])
    return y, derivative.bind(ad.instantiate_zeros(x_dot), saved, kind=kind)


forward = RowwisePrimitive(
    "quack_jax_softmax",
    kernel=_kernel,
    prefers_reference=forward_on_xla,
    reference=reference_forward,
    jvp=_jvp,
)
