"""The properties every op has, each written once and run for every op (the adapters of
``ops.py``) on both backends: its values and gradients against the op's float64
reference, compiled and eager, without its options and with them, under vmap (over
either axis, and over leading axes without it), jax.checkpoint and lax.scan; with x64 on
(float32 inputs on the kernels, float64 ones on XLA) and float64 inputs with x64 off
(taken as float32); no rows and one row (also without a leading axis); and the bad
arguments, each refused eagerly and under jit with an error that names the argument.
The sharded properties (jit of split rows, shard_map) are in ``test_sharding.py``.

The gpu tests draw each op's inputs at a row length its family's SPEC builds
(``test_gpu_lengths_are_built``).
"""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import BACKENDS, gpu_lengths, key_for, run_launching
from ops import OPS, as_device, check, reference_of_parts, results

ROWS = 5
BATCH = (3, 4)  # vmap's examples (or scan's microbatches) and their rows
CASES = [
    pytest.param(b, op, marks=[pytest.mark.gpu] if b == "gpu" else [], id=f"{b}-{op.name}")
    for b in BACKENDS
    for op in OPS
]


def both(op, remat=False):
    """The op's results without its options and with them."""
    return lambda a: [results(op, options, remat)(a) for options in (False, True)]


def draw(op, backend, lead, dtype, *key):
    return op.draw(lead, op.n[backend], dtype, key_for(op.name, lead, dtype, *key))


def check_both(op, got, a, what):
    for options, results_ in zip((False, True), got, strict=True):
        check(op, results_, op.reference(a, options), f"{what} options={options}")


@pytest.mark.parametrize(("backend", "op"), CASES)
def test_jit_and_eager(backend, op):
    a = draw(op, backend, (ROWS,), "float32", "jit")
    check_both(op, run_launching(backend, both(op), as_device(a)), a, "jit")
    check_both(op, both(op)(as_device(a)), a, "eager")


def batch_axes(op, a, axis):
    """vmap's in_axes: ``axis`` for the per-row arguments, None for the shared ones."""
    return ({k: axis if k in op.rows else None for k in a},)


def moved(op, a):
    """The per-row arguments with their first two axes swapped."""
    return {k: np.swapaxes(v, 0, 1) if k in op.rows else v for k, v in a.items()}


def vmapped(op):
    """(arguments, the same with the batch axis second) -> for each of without and with
    options: vmap over the first axis, over the second, and no vmap (two leading axes)."""

    def f(a, swapped):
        out = []
        for options in (False, True):
            fn = results(op, options)
            first = jax.vmap(fn, in_axes=batch_axes(op, a, 0))(a)
            second = jax.vmap(fn, in_axes=batch_axes(op, swapped, 1))(swapped)
            out.append((first, second, fn(a)))
        return out

    return f


@pytest.mark.parametrize(("backend", "op"), CASES)
def test_vmap(backend, op):
    """Over the first or the second axis of the per-row arguments, the shared ones
    unbatched (their gradients per example); and the same rows as two leading axes."""
    a = draw(op, backend, BATCH, "float32", "vmap")
    got = run_launching(backend, vmapped(op), as_device(a), as_device(moved(op, a)))
    for options, (first, second, leading) in zip((False, True), got, strict=True):
        want = reference_of_parts(op, a, options, range(BATCH[0]), "stack")
        check(op, first, want, f"vmap options={options}")
        check(op, second, want, f"vmap over axis 1 options={options}")
        check(op, leading, op.reference(a, options), f"leading axes options={options}")


@pytest.mark.parametrize(("backend", "op"), CASES)
def test_checkpoint(backend, op):
    """The gradients through jax.checkpoint (the forward runs again in the backward)."""
    a = draw(op, backend, (ROWS,), "float32", "checkpoint")
    got = run_launching(backend, both(op, remat=True), as_device(a))
    check_both(op, got, a, "checkpoint")


def scanned(op):
    """lax.scan over microbatches (the first axis of the per-row arguments): the shared
    arguments' gradients and the scalar losses summed in the carry, the rest stacked."""
    params = {f"d{p}" for p in op.params}

    def f(a):
        shared = {k: v for k, v in a.items() if k not in op.rows}
        batches = {k: v for k, v in a.items() if k in op.rows}
        out = []
        for options in (False, True):
            fn = results(op, options)
            first = {k: v[0] for k, v in batches.items()}
            shapes = jax.eval_shape(fn, {**shared, **first})
            summed = [k for k, s in shapes.items() if k in params or not s.shape]

            def body(carry, batch, fn=fn, summed=summed):
                r = fn({**shared, **batch})
                return {k: carry[k] + r[k] for k in summed}, {
                    k: v for k, v in r.items() if k not in summed
                }

            init = {k: jnp.zeros(shapes[k].shape, shapes[k].dtype) for k in summed}
            carry, stacked = jax.lax.scan(body, init, batches)
            out.append({**carry, **stacked})
        return out

    return f


@pytest.mark.parametrize(("backend", "op"), CASES)
def test_scan(backend, op):
    a = draw(op, backend, BATCH, "float32", "scan")
    got = run_launching(backend, scanned(op), as_device(a))
    for options, r in zip((False, True), got, strict=True):
        want = reference_of_parts(op, a, options, range(BATCH[0]), "scan")
        check(op, r, want, f"scan options={options}")


@pytest.mark.parametrize(("backend", "op"), CASES)
def test_x64(backend, op):
    """With x64 on: float32 inputs take the kernels, float64 ones XLA's formulation, in
    float64 (not on the GPU for the linear ops: XLA's float64 GEMM fails there)."""
    with jax.enable_x64(True):
        a = draw(op, backend, (ROWS,), "float32", "x64")
        check_both(op, run_launching(backend, both(op), as_device(a)), a, "x64 float32")
        if backend == "gpu" and not op.gpu_float64:
            return
        a = draw(op, backend, (ROWS,), "float64", "x64")
        got = run_launching(backend, both(op), as_device(a), kernels=False)
        check_both(op, got, a, "float64")


def assert_same_bits(got, want, what):
    assert set(got) == set(want), what
    for k in want:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.dtype == w.dtype == np.float32, (what, k, g.dtype)
        assert g.tobytes() == w.tobytes(), f"{what}: {k}"


@pytest.mark.parametrize(("backend", "op"), CASES)
def test_float64_without_x64(backend, op):
    """numpy float64 arguments with x64 off are float32 ones, as everywhere in JAX: the
    outputs (numpy to the op itself) and gradients of their float32 values, bit for bit,
    and the reference's."""
    with jax.enable_x64(False):
        a = draw(op, backend, (ROWS,), "float64", "float64 without x64")
        a32 = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in a.items()}
        for options in (False, True):
            what = f"float64 without x64 options={options}"
            want = op.forward(as_device(a32), options)
            assert_same_bits(op.forward(a, options), want, what)
            want = results(op, options)(as_device(a32))
            got = results(op, options)(a)
            assert_same_bits(got, want, what)
            check(op, got, op.reference(a32, options), what)


@pytest.mark.parametrize(("backend", "op"), CASES)
def test_empty_rows(backend, op):
    """No rows (of rank 2 and 3): no kernel, outputs of the right shapes and dtypes, the
    shared arguments' gradients 0, a mean loss NaN."""
    for lead in ((0,), (2, 0)):
        a = draw(op, backend, lead, "float32", "empty")
        got = run_launching(backend, both(op), as_device(a), kernels=False)
        check_both(op, got, a, f"rows {lead}")


@pytest.mark.parametrize(("backend", "op"), CASES)
def test_one_row(backend, op):
    """One row, with a leading axis and without one."""
    for lead in ((1,), ()):
        a = draw(op, backend, lead, "float32", "one row")
        got = run_launching(backend, both(op), as_device(a))
        check_both(op, got, a, f"rows {lead}")


def _bad_id(op, change):
    (name, value), *_ = change.items()
    if isinstance(value, np.ndarray | jax.Array):
        value = f"{value.dtype}{list(value.shape)}"
    return f"{op.name}-{name}={value!s:.24}"


BAD = [
    pytest.param(
        b, op, i, marks=[pytest.mark.gpu] if b == "gpu" else [], id=f"{b}-{_bad_id(op, case[0])}"
    )
    for b in BACKENDS
    for op in OPS
    for i, case in enumerate(op.bad())
]


@pytest.mark.parametrize(("backend", "op", "case"), BAD)
def test_bad_argument(backend, op, case):
    """The op's error, naming the argument (one of its parameters), eagerly and with the
    array arguments traced under jit."""
    change, error, message = op.bad()[case]
    argument = re.match(r"\w+", message).group()
    assert argument in inspect.signature(op.fn).parameters, message
    args = {**op.bad_arguments(), **change}
    with pytest.raises(error, match=re.escape(f"{op.name}: {message}")):
        op.fn(**args)
    traced = {k: v for k, v in args.items() if isinstance(v, np.ndarray | jax.Array)}
    static = {k: v for k, v in args.items() if k not in traced}
    with pytest.raises(error, match=re.escape(f"{op.name}: {message}")):
        jax.jit(lambda t: op.fn(**t, **static)).trace(traced)


def test_gpu_lengths_are_built():
    """Each op's gpu draws have a row length that its family's SPEC builds kernels for
    (with every variant the suite launches): prebuild builds no others."""
    for op in OPS:
        assert op.n["gpu"] in gpu_lengths(op.name), op.name
