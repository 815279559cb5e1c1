"""Flax modules backed by quack_jax: drop-in ``RMSNorm`` and ``LayerNorm`` for linen and nnx,
and LM heads whose cross-entropy never makes the logits.

Swap the import and keep the rest of the model, its parameters and its checkpoints::

    from quack_jax.flax import linen as qnn  # instead of flax.linen's norms
    norm = qnn.RMSNorm(epsilon=1e-6)

    from quack_jax.flax import nnx as qnnx  # instead of flax.nnx's norms
    norm = qnnx.LayerNorm(num_features=1024, rngs=nnx.Rngs(0))

Each class subclasses Flax's own and takes the same arguments, creates the same parameters
and follows the same dtype rules; only ``__call__`` differs. It runs
:func:`quack_jax.rms_norm` / :func:`quack_jax.layer_norm` when normalising a floating input
over its last axis (``reduction_axes`` and ``feature_axes`` the last axis, no ``axis_name``,
``axis_index_groups`` or ``mask``), and Flax's own code for everything else. The variance
is always the centred one, so ``use_fast_variance`` changes nothing but rounding.

The LM heads run :func:`quack_jax.linear_cross_entropy` on a head's own parameters, with
its dtype promotion and precision: ``nnx.linear_cross_entropy(head, x, labels)`` for an
``nnx.Linear`` head or a tied ``nnx.Embed``; ``linen.DenseCrossEntropy`` (a ``Dense`` with
the same parameters, called with the labels) and ``linen.embed_cross_entropy(embed, x,
labels)`` for a tied ``nn.Embed``.

Flax is an optional dependency: ``import quack_jax`` never imports it, this package does,
and without it raises a ``ModuleNotFoundError`` that says how to install it. ``linen`` and
``nnx`` are imported when first used, each without the other: ``from quack_jax.flax import
linen`` never imports ``flax.nnx``, and ``quack_jax.flax.nnx`` needs nothing of
``flax.linen``.
"""

import importlib
import importlib.util

if importlib.util.find_spec("flax") is None:
    raise ModuleNotFoundError(
        "quack_jax.flax needs Flax, which is not installed: pip install flax",
        name="flax",
    )

__all__ = ["linen", "nnx"]


def __getattr__(name):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
