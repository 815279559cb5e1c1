"""The private JAX APIs quack_jax uses, in one place, each with the reason it is needed.

Everything else in quack_jax uses JAX's public API (``jax.extend``, ``jax.interpreters``).
"""

from __future__ import annotations

import functools

from jax._src import dispatch
from jax.extend import core


def new_primitive(name: str) -> core.Primitive:
    """A primitive with several results, for ops whose lowering partitions itself.

    - ``dispatch.apply_primitive`` is its eager rule: it runs the primitive alone through
      jit, as JAX's own primitives do. ``jax.extend`` offers no public rule for that.
    - ``dispatch.prim_requires_devices_during_lowering`` makes JAX give the lowering the
      device assignment. The lowering builds a ``custom_partitioning`` call, which needs
      the mesh. No public API sets this.
    """
    p = core.Primitive(name)
    p.multiple_results = True
    p.def_impl(functools.partial(dispatch.apply_primitive, p))
    dispatch.prim_requires_devices_during_lowering.add(p)
    return p
