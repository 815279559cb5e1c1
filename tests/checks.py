"""What every op's test suite shares: the backends, the op's test grid from its SPEC,
fresh random keys, the one tolerance table and float64 comparison, and a compile that
counts kernel launches.

Each test runs on both backends where it can: "cpu" runs the XLA fallback on the CPU
device (everywhere), "gpu" runs the kernels (marked ``gpu``: skipped without an sm_90
GPU; their outputs are filled with NaN before each launch, see ``conftest.py``). Inputs
are fresh random draws each run; the seed is printed with any failure.
"""

import itertools
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quack_jax
from quack_jax import _ffi
from quack_jax._registry import specs

# Fresh inputs each run; QUACK_JAX_TEST_SEED replays the seed a failure printed.
SEED = int(os.environ.get("QUACK_JAX_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
# Allowed error, relative to the magnitude of the terms that make each element.
TOL = {"float32": 2e-5, "bfloat16": 1e-2, "float16": 2e-3, "float64": 1e-12}
# Largest test tensor, in elements: bounds the float64 reference's memory.
MAX_ELEMENTS = 2**28
BACKENDS = ("cpu", "gpu")


def backend_param(backend, *values):
    """A pytest.param of (backend, *values), marked ``gpu`` for the kernels' backend."""
    marks = [pytest.mark.gpu] if backend == "gpu" else []
    return pytest.param(backend, *values, marks=marks, id="-".join(map(str, (backend, *values))))


def backends(*names):
    """The ``backend`` parametrisation: both, or the ones named."""
    return [backend_param(b) for b in names or BACKENDS]


def grid(op, *, special=False, dtypes=None, backends=BACKENDS):
    """(backend, m, n, dtype) over the test grid of ``op``'s SPEC on each backend (with
    ``special``: (backend, n, dtype) over its special-value row lengths), skipping the
    tensors past MAX_ELEMENTS."""
    out = []
    for backend in backends:
        shapes = specs()[op].tests[backend]
        kinds = dtypes or shapes.dtypes
        if special:
            out += [backend_param(backend, n, d) for n in shapes.special for d in kinds]
        else:
            for m, n, d in itertools.product(shapes.rows, shapes.sizes, kinds):
                if m * n <= MAX_ELEMENTS:
                    out.append(backend_param(backend, m, n, d))
    return out


def gpu_lengths(op) -> set[int]:
    """The row lengths at which the SPEC of ``op``'s family builds the kernels its gpu
    tests launch (``benchmarks/prebuild.py`` builds no others)."""
    return set(specs()[op].tests["gpu"].lengths)


def key_for(*parts):
    return jax.random.key(SEED ^ zlib.crc32(repr(parts).encode()))


def _on_device(*arrays):
    """Whether any of the arrays lives on an accelerator (compared there, in jnp)."""
    return any(
        isinstance(a, jax.Array) and any(d.platform != "cpu" for d in a.devices()) for a in arrays
    )


def assert_close(out, ref, mag, dtype, what, **inputs):
    """NaN where the reference is NaN, equal where it is infinite, and elsewhere within
    TOL of ``mag``, the size of the terms that make the element (plus the dtype's
    smallest normal, below which it loses relative precision). Host arrays are compared
    in numpy (nothing to compile per shape), device arrays on the device."""
    xp = jnp if _on_device(out, ref, mag) else np
    with jax.enable_x64(True):
        o = xp.asarray(out).astype(xp.float64)
        r, mag = xp.asarray(ref, xp.float64), xp.asarray(mag, xp.float64)
        bound = TOL[dtype] * mag + float(jnp.finfo(dtype).smallest_normal)
        with np.errstate(invalid="ignore"):
            close = xp.abs(o - r) <= bound
        finite = xp.isfinite(r) & xp.isfinite(o)
        ok = (xp.isnan(o) & xp.isnan(r)) | (o == r) | (finite & close)
        bad = int(xp.sum(~ok))
        if bad:
            o, r, ok, bound = (np.atleast_1d(np.asarray(a)) for a in (o, r, ok, bound))
            bound = np.broadcast_to(bound, o.shape)
            idx = np.unravel_index(int(np.argmin(ok.ravel())), o.shape)
            row = (*idx[:-1], slice(max(idx[-1] - 3, 0), idx[-1] + 4))
            detail = "".join(
                f"\n  {name}[{idx[-1] - 3}:]: {np.asarray(a, np.float64)[row]}"
                for name, a in {"out": o, "ref": r, "bound": bound, **inputs}.items()
                if np.ndim(a) == o.ndim
            )
            pytest.fail(
                f"{what}: {bad} of {o.size} elements wrong (seed {SEED}); first at {idx}: "
                f"got {float(o[idx])}, want {float(r[idx])}{detail}"
            )


def run(backend, f, *args, launches):
    """Compile ``f``, check it launches quack_jax kernels ``launches`` times on the "gpu"
    backend and none on the "cpu" one, run it."""
    lowered = jax.jit(f).lower(*args)
    want = launches if backend == "gpu" else 0
    assert lowered.as_text().count(f"custom_call @{_ffi.TARGET}") == want
    return lowered.compile()(*args)


def gemm_count(f, *args) -> int:
    """The GEMMs (``dot_general``) in the lowering of ``jax.jit(f)`` on ``args``: a
    chunked loop has each one twice, in its first chunk's body and in the loop's."""
    return jax.jit(f).lower(*args).as_text().count("stablehlo.dot_general")


def run_launching(backend, f, *args, kernels=True):
    """Compile ``f``, check it launches quack_jax kernels on the "gpu" backend (some, or
    none without ``kernels``) and none on the "cpu" one, run it: for programs whose
    number of launches is the transforms' business (vmap, scan, checkpoint)."""
    lowered = jax.jit(f).lower(*args)
    count = lowered.as_text().count(f"custom_call @{_ffi.TARGET}")
    assert (count > 0) == (backend == "gpu" and kernels), f"{count} kernel launches"
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
