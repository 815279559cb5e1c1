"""What the GPU tests share: fresh random keys, the float64 comparison, and a compile
that counts kernel launches. Inputs are fresh random draws each run; the seed is printed
with any failure."""

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quack_jax import _ffi

SEED = int.from_bytes(os.urandom(4), "little")
# Allowed error, relative to the magnitude of the terms that make each element.
TOL = {"float32": 2e-5, "bfloat16": 1e-2, "float16": 2e-3}


def key_for(*parts):
    return jax.random.key(SEED ^ zlib.crc32(repr(parts).encode()))


def assert_close(out, ref, mag, dtype, what, **inputs):
    """NaN where the reference is NaN, equal where it is infinite, and elsewhere within
    TOL of ``mag``, the size of the terms that make the element (plus the dtype's
    smallest normal, below which it loses relative precision)."""
    with jax.enable_x64(True):
        o, r = jnp.asarray(out).astype(jnp.float64), jnp.asarray(ref, jnp.float64)
        finite = jnp.isfinite(r)
        bound = TOL[dtype] * mag + float(jnp.finfo(dtype).smallest_normal)
        close = jnp.abs(o - r) <= bound
        ok = (jnp.isnan(o) & jnp.isnan(r)) | (o == r) | (finite & jnp.isfinite(o) & close)
        bad = int(jnp.sum(~ok))
        if bad:
            idx = np.unravel_index(int(jnp.argmin(ok.ravel())), o.shape)
            row = (*idx[:-1], slice(max(idx[-1] - 3, 0), idx[-1] + 4))
            detail = "".join(
                f"\n  {name}[{idx[-1] - 3}:]: {np.asarray(jnp.asarray(a)[row], np.float64)}"
                for name, a in {"out": o, "ref": r, "bound": bound, **inputs}.items()
                if jnp.ndim(a) == o.ndim
            )
            pytest.fail(
                f"{what}: {bad} of {o.size} elements wrong (seed {SEED}); first at {idx}: "
                f"got {float(o[idx])}, want {float(r[idx])}{detail}"
            )


def run_kernels(f, *args, launches):
    """Compile ``f``, check it launches quack_jax kernels ``launches`` times, run it."""
    lowered = jax.jit(f).lower(*args)
    assert lowered.as_text().count(f"custom_call @{_ffi.TARGET}") == launches
    return lowered.compile()(*args)
