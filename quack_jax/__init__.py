"""quack_jax: memory-bound kernels for JAX at the bandwidth limit of Hopper GPUs.

On a CUDA device with compute capability 9.0 the ops run CuTe-DSL kernels compiled to
cubins and launched through an XLA FFI custom call; everywhere else they run an XLA
reference with the same semantics.
"""

from . import _ffi, export
from ._cache import MissingKernelError
from .cross_entropy import (
    cross_entropy,
    softmax_cross_entropy_with_integer_labels,
    token_logprobs,
)
from .linear_cross_entropy import (
    linear_cross_entropy,
    linear_token_logprobs,
    linear_token_loss,
)
from .norm import layer_norm, rms_norm
from .softmax import log_softmax, softmax

if _ffi.LIBRARY.exists():  # so that deserialised exports find the launcher
    _ffi.register_target()

__version__ = "0.1.0"
__all__ = [
    "MissingKernelError",
    "cross_entropy",
    "export",
    "layer_norm",
    "linear_cross_entropy",
    "linear_token_logprobs",
    "linear_token_loss",
    "log_softmax",
    "rms_norm",
    "softmax",
    "softmax_cross_entropy_with_integer_labels",
    "token_logprobs",
]
