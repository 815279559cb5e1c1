"""The RMSNorm and LayerNorm kernels on an sm_90 GPU, against float64 references.

Every launch here fills its outputs with NaN first (QUACK_JAX_POISON_OUTPUTS), so an
element a kernel fails to write shows up as a NaN where the reference has a number (the
weight-gradient partials too: a missing row makes the sum NaN). ``prebuild_cases`` lists
what these tests lower, for ``benchmarks/prebuild.py``.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close, key_for
from shapes import GPU_DTYPES, NORM_ROWS, NORM_SIZES, NORM_VARIANT_SIZES, SPECIAL_SIZES

import quack_jax

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

EPS = 1e-5
OPS = ("rms_norm", "layer_norm")
# rows of float64 reference per chunk: bounds its memory for the largest shapes
CHUNK_ELEMENTS = 2**25


@dataclasses.dataclass(frozen=True)
class Mix:
    """Which operands a call has: weight (and bias, LayerNorm only) dtype, "x" for x's."""

    name: str
    params: str | None = None
    bias: bool = False
    residual: bool = False
    prenorm: bool = False
    offset: float = 0.0
    out: str | None = None

    def dtypes(self, dtype):
        param = None if self.params is None else dtype if self.params == "x" else self.params
        return param, self.out or dtype


MIXES = (
    Mix("plain"),
    Mix("weight_residual_prenorm", params="x", residual=True, prenorm=True),
    Mix("fp32_params_offset", params="float32", bias=True, offset=1.0),
    Mix("residual_fp32_out", params="x", bias=True, residual=True, out="float32"),
)


def cases():
    """(op, m, n, dtype, mix): every shape and dtype with the mixes in turn, and every mix
    at m = 1000 for the sizes in NORM_VARIANT_SIZES."""
    out = []
    for op in OPS:
        shapes = itertools.product(NORM_ROWS, NORM_SIZES, GPU_DTYPES)
        out += [(op, m, n, d, MIXES[i % len(MIXES)]) for i, (m, n, d) in enumerate(shapes)]
        out += [
            (op, 1000, n, d, mix)
            for n, d, mix in itertools.product(NORM_VARIANT_SIZES, GPU_DTYPES, MIXES)
        ]
    return list(dict.fromkeys(out))


def forward_backward(op, mix):
    """(x, weight, bias, residual, dy, dh) -> (outputs, gradients) through ``jax.vjp``."""
    fn = getattr(quack_jax, op)

    def f(x, w, b, r):
        params = (w,) if op == "rms_norm" else (w, b)
        return fn(
            x,
            *params,
            eps=EPS,
            residual=r,
            prenorm=mix.prenorm,
            weight_offset=mix.offset,
            out_dtype=mix.out,
        )

    def run(x, w, b, r, dy, dh):
        out, vjp = jax.vjp(f, x, w, b, r)
        return out, vjp((dy, dh) if mix.prenorm else dy)

    return run


def operand_specs(op, m, n, dtype, mix):
    param, out = mix.dtypes(dtype)
    row = jax.ShapeDtypeStruct((m, n), dtype)
    vec = jax.ShapeDtypeStruct((n,), param) if param else None
    bias = vec if op == "layer_norm" and mix.bias else None
    return (
        row,
        vec,
        bias,
        row if mix.residual else None,
        jax.ShapeDtypeStruct((m, n), out),
        row if mix.prenorm else None,
    )


def prebuild_cases():
    """(fn, shape-dtype structs) for everything these tests run through kernels."""
    for op, m, n, dtype, mix in cases():
        yield forward_backward(op, mix), operand_specs(op, m, n, dtype, mix)
    for op, n, dtype in itertools.product(OPS, SPECIAL_SIZES, GPU_DTYPES):
        yield forward_backward(op, MIXES[2]), operand_specs(op, 8, n, dtype, MIXES[2])
    run, specs = forward_backward("rms_norm", MIXES[1]), vmap_specs()
    yield run, specs
    yield jax.vmap(run, in_axes=VMAP_AXES), [rank3(s) for s in specs]


# test_batched_and_rank3: rms_norm on (6, 7, 100) bfloat16, vmapped over the first axis
VMAP_AXES = (0, None, None, 0, 0, 0)


def vmap_specs():
    return operand_specs("rms_norm", 6 * 7, 100, "bfloat16", MIXES[1])


def rank3(spec):
    """A (6 * 7, n) row spec as (6, 7, n); vectors and absent operands unchanged."""
    if spec is None or len(spec.shape) == 1:
        return spec
    return jax.ShapeDtypeStruct((6, 7, spec.shape[-1]), spec.dtype)


def random_operands(op, m, n, dtype, mix, key):
    specs = operand_specs(op, m, n, dtype, mix)
    keys = jax.random.split(key, len(specs))
    scale = (2.0, 0.2, 0.5, 1.0, 1.0, 1.0)
    shift = (0.5, 1.0, 0.0, 0.0, 0.0, 0.0)
    return [
        None
        if s is None
        else (shift[i] + scale[i] * jax.random.normal(keys[i], s.shape, jnp.float32)).astype(
            s.dtype
        )
        for i, s in enumerate(specs)
    ]


def reference(op, mix):
    """A function of the operands giving float64 results, and the magnitudes of the terms
    that make each (what the error is judged against): y, h, dx, dweight, dbias."""

    def g(h, w, b):
        mean = 0.0 if op == "rms_norm" else jnp.mean(h, axis=-1, keepdims=True)
        rstd = 1.0 / jnp.sqrt(jnp.mean((h - mean) ** 2, axis=-1, keepdims=True) + EPS)
        xhat = (h - mean) * rstd
        y = xhat if w is None else xhat * (w + mix.offset)
        return (y if b is None else y + b), (rstd, (jnp.abs(h) + jnp.abs(mean)) * rstd)

    @jax.jit
    def ref(x, w, b, r, dy, dh):
        f64 = jnp.float64
        h = x.astype(f64)
        w, b = (None if a is None else a.astype(f64) for a in (w, b))
        y, vjp, (rstd, terms) = jax.vjp(g, h, w, b, has_aux=True)
        dy = dy.astype(f64)
        dx, dw, db = vjp(dy)
        scale = 1.0 if w is None else jnp.abs(w + mix.offset)
        y_mag = terms * scale + (0.0 if b is None else jnp.abs(b))
        gx = jnp.abs(dy) * scale
        dx_mag = gx + terms * jnp.mean(gx * terms, axis=-1, keepdims=True)
        if op == "layer_norm":
            dx_mag = dx_mag + jnp.mean(gx, axis=-1, keepdims=True)
        dx_mag = dx_mag * rstd
        if dh is not None:
            dx, dx_mag = dx + dh.astype(f64), dx_mag + jnp.abs(dh.astype(f64))
        grads = (dw, jnp.sum(jnp.abs(dy) * terms, axis=0), db, jnp.sum(jnp.abs(dy), axis=0))
        return (y, y_mag, h, dx, dx_mag), grads

    return ref


def residual_sum(x, r):
    """h = x + r rounded to x's dtype, on the host: on a GPU, XLA drops a narrowing convert
    that is widened again (and reduce_precision flushes float16 subnormals)."""
    total = np.asarray(x, np.float32) + np.asarray(r, np.float32)
    return jnp.asarray(total.astype(np.asarray(x).dtype))


def check(op, mix, operands, out, grads, what):
    """Compare outputs and gradients with the float64 reference, a chunk of rows at a time."""
    x, w, b, r, dy, _ = operands
    y, h = out if mix.prenorm else (out, None)
    dx, dw, db, dr = grads
    dtype, (param, out_dtype) = x.dtype.name, mix.dtypes(x.dtype.name)
    m, n = x.shape
    step = max(1, CHUNK_ELEMENTS // max(n, 1))
    sums = None
    ref = reference(op, mix)
    with jax.enable_x64(True):
        for start in range(0, m, step):
            rows = slice(start, start + step)
            chunk = [None if a is None or a.ndim == 1 else a[rows] for a in operands]
            chunk[1:3] = w, b
            if r is not None:
                chunk[0:4:3] = residual_sum(chunk[0], chunk[3]), None
            (y_ref, y_mag, h_ref, dx_ref, dx_mag), parts = ref(*chunk)
            where = f"{what} rows {start}:"
            assert_close(y[rows], y_ref, y_mag, out_dtype, f"y {where}", x=x[rows])
            if h is not None:
                assert_close(h[rows], h_ref, jnp.abs(h_ref) / 2, dtype, f"h {where}")
            assert_close(dx[rows], dx_ref, dx_mag, dtype, f"dx {where}", x=x[rows], dy=dy[rows])
            sums = parts if sums is None else jax.tree.map(lambda a, b: a + b, sums, parts)
        if w is not None:
            assert dw.dtype == w.dtype
            assert_close(dw[None], sums[0][None], sums[1][None], param, f"dweight {what}")
        if b is not None:
            assert db.dtype == b.dtype
            assert_close(db[None], sums[2][None], sums[3][None], param, f"dbias {what}")
    if r is not None:
        assert np.array_equal(np.asarray(dr), np.asarray(dx)), "dresidual differs from dx"


def compiled(fn, operands, launches=2):
    lowered = jax.jit(fn).lower(*operands)
    assert lowered.as_text().count("custom_call @quack_jax_launch") == launches
    return lowered.compile()


@pytest.mark.parametrize(
    "op,m,n,dtype,mix", cases(), ids=lambda v: getattr(v, "name", None) or str(v)
)
def test_forward_backward(op, m, n, dtype, mix):
    operands = random_operands(op, m, n, dtype, mix, key_for(op, m, n, dtype, mix.name))
    run = compiled(forward_backward(op, mix), operands)
    out, grads = run(*operands)
    check(op, mix, operands, out, grads, f"{op} {mix.name} {m}x{n} {dtype}")
    again = run(*operands)[1]
    for first, second in zip(grads[1:3], again[1:3], strict=True):
        if first is not None:
            assert np.asarray(first).tobytes() == np.asarray(second).tobytes(), "not bitwise"


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("n", SPECIAL_SIZES)
@pytest.mark.parametrize("op", OPS)
def test_special_values(op, n, dtype):
    mix = MIXES[2]
    operands = random_operands(op, 8, n, dtype, mix, key_for("special", op, n, dtype))
    big = 6e4 if dtype == "float16" else 1e4
    x = np.array(operands[0].astype(jnp.float32))
    x[0, n // 2] = np.nan
    x[1, n // 3] = np.inf
    x[2, :] = -np.inf
    x[3, ::2] = big
    x[4, :] = big
    x[5, n - 1] = -big
    operands[0] = jnp.asarray(x).astype(dtype)
    out, grads = compiled(forward_backward(op, mix), operands)(*operands)
    check(op, mix, operands, out, grads, f"{op} special values n={n} {dtype}")


def test_batched_and_rank3():
    """vmap over a rank-3 input with a shared weight, its gradient, and per-example
    gradients, against the same computation on the folded rows."""
    mix = MIXES[1]
    x, w, _, r, dy, dh = random_operands("rms_norm", 6 * 7, 100, "bfloat16", mix, key_for("vmap"))
    x3, r3, dy3, dh3 = (a.reshape(6, 7, 100) for a in (x, r, dy, dh))
    run = forward_backward("rms_norm", mix)
    folded_out, folded_grads = compiled(run, (x, w, None, r, dy, dh))(x, w, None, r, dy, dh)
    out, grads = jax.jit(jax.vmap(run, in_axes=VMAP_AXES))(x3, w, None, r3, dy3, dh3)
    batched = jax.tree.leaves((out, grads[0]))
    for a, b in zip(batched, jax.tree.leaves((folded_out, folded_grads[0])), strict=True):
        np.testing.assert_array_equal(np.asarray(a).reshape(b.shape), np.asarray(b))
    per_example = grads[1]
    np.testing.assert_allclose(
        np.asarray(jnp.sum(per_example.astype(jnp.float32), axis=0)),
        np.asarray(folded_grads[1].astype(jnp.float32)),
        rtol=2e-2,
        atol=2e-2,
    )
