"""What the GPU tests share: fresh random keys, the float64 comparison, and a compile
that counts kernel launches. Inputs are fresh random draws each run; the seed is printed
with any failure."""

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quack_jax
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


def sharding_losses(n):
    """name -> loss of (x, weight, labels) for rows of length ``n``: every public op and its
    gradient, with the options that change which kernels run (the sharding tests)."""
    coords = jnp.linspace(0.5, 1.5, n)  # positive: the losses do not cancel

    def norm(fn, **kw):
        def loss(x, w, labels):
            y = fn(x, w, **kw)
            y, h = y if kw.get("prenorm") else (y, x)
            return jnp.sum(y * coords) + 0.5 * jnp.sum(jnp.square(h.astype(jnp.float32)))

        return loss

    def ce(**kw):
        def loss(x, w, labels):
            out = quack_jax.cross_entropy(x, labels, **kw)
            return jnp.sum(out[0] + out[1]) if kw.get("return_lse") else jnp.sum(out)

        return loss

    return {
        "softmax": lambda x, w, labels: jnp.sum(quack_jax.softmax(x) * coords),
        "log_softmax": lambda x, w, labels: jnp.sum(quack_jax.log_softmax(x) * coords),
        "rms_norm": norm(quack_jax.rms_norm),
        "rms_norm_residual": norm(
            lambda x, w, **kw: quack_jax.rms_norm(x, w, residual=x * 0.5, **kw), prenorm=True
        ),
        "layer_norm": norm(lambda x, w: quack_jax.layer_norm(x, w, w * 0.1)),
        "cross_entropy_mean": ce(label_smoothing=0.1),
        "cross_entropy_rows": ce(reduction="none", return_lse=True, z_loss=1e-3),
    }
