"""The lowering's choice of path by shape (``_primitive.REFERENCE_FASTER``): small softmax
and norm forwards, and RMSNorm's over QK-norm rows, lower to XLA's formulation, except
the norm forward under autodiff, which goes with its backward (both to XLA at the
shapes of ``norm_pair_on_xla``); so does softmax's derivative over small short rows, and
every other kernel stays; ``lowering_path`` overrides the choice, and bad paths raise
ValueError. On the GPU, the training path at a small shape gives the float64 result.
(Every other test lowers with ``lowering_path("kernel")``: see conftest.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quack_jax
from quack_jax import _ffi
from quack_jax._lowering import lowering, lowering_path, options
from quack_jax.build import lower_for_cuda
from quack_jax.norm.rules import NORM_BYTES, NORM_PAIR, QK_NORM
from quack_jax.softmax.rules import SOFTMAX_BYTES, SOFTMAX_DERIVATIVE_N

N = 1024
W = np.linspace(0.5, 1.5, N, dtype=np.float32)
# op: (forward, the most bfloat16 bytes of input that its forward sends to XLA, or 0)
FORWARDS = {
    "softmax": (lambda x: quack_jax.softmax(x), SOFTMAX_BYTES),
    "rms_norm": (lambda x: quack_jax.rms_norm(x, W), NORM_BYTES),
    "layer_norm": (lambda x: quack_jax.layer_norm(x, W, W), NORM_BYTES),
    "cross_entropy": (
        lambda x: quack_jax.cross_entropy(x, jnp.zeros(x.shape[0], jnp.int32), reduction="none"),
        0,
    ),
}


def launches(fn, rows, n=N, path="auto"):
    text = lower_for_cuda(fn, (jax.ShapeDtypeStruct((rows, n), jnp.bfloat16),), path=path)
    return text.count(f"custom_call @{_ffi.TARGET}")


@pytest.mark.parametrize("name", FORWARDS)
def test_small_forwards_lower_to_xla_where_it_is_faster(name):
    fn, most = FORWARDS[name]
    if most:
        assert launches(fn, most // (N * 2)) == 0
        assert launches(fn, 1) == 0
    else:
        pytest.importorskip("cutlass")  # compiles the kernel it launches
        assert launches(fn, 1) == 1


def test_qk_norm_forward_lowers_to_xla():
    rms = lambda x: quack_jax.rms_norm(x, jnp.ones(x.shape[-1]))  # noqa: E731
    assert launches(rms, 2**21, n=QK_NORM) == 0


def grad_of(fn):
    return jax.grad(lambda x: jnp.sum(fn(x).astype(jnp.float32)))


@pytest.mark.cutlass
@pytest.mark.parametrize("name", ["rms_norm", "layer_norm"])
def test_small_norm_forward_under_autodiff_keeps_its_kernel(name):
    """Training at a small shape: the norm forward (whose statistics the backward kernel
    reads) and the backward launch their kernels; QK-norm rows too."""
    fn, _ = FORWARDS[name]
    assert launches(grad_of(fn), 8) == 2
    if name == "rms_norm":
        rms = lambda x: quack_jax.rms_norm(x, jnp.ones(x.shape[-1]))  # noqa: E731
        assert launches(grad_of(rms), 2**21, n=QK_NORM) == 2


NORMS = {
    "rms_norm": lambda x: quack_jax.rms_norm(x, jnp.ones(x.shape[-1])),
    "layer_norm": lambda x: quack_jax.layer_norm(x, jnp.ones(x.shape[-1]), jnp.ones(x.shape[-1])),
}


def pair_edges(name):
    """The shortest rows the norm's fwd+bwd goes to XLA over, and the fewest and most rows
    of those (bfloat16)."""
    fewest, shortest, most = NORM_PAIR[name == "rms_norm"]
    n = max(shortest, N)
    return n, fewest, most // (n * 2)


@pytest.mark.parametrize("name", NORMS)
def test_small_norm_fwd_bwd_lowers_to_xla(name):
    """Between the edges of ``norm_pair_on_xla``, the norm's forward under autodiff and its
    backward both lower to XLA's formulation."""
    n, fewest, most = pair_edges(name)
    assert launches(grad_of(NORMS[name]), fewest, n=n) == 0
    assert launches(grad_of(NORMS[name]), most, n=n) == 0


@pytest.mark.cutlass
@pytest.mark.parametrize("name", NORMS)
def test_norm_fwd_bwd_keeps_its_kernels_outside_the_pair_rule(name):
    """Fewer rows, more bytes (and for RMSNorm shorter rows): both kernels launch."""
    n, fewest, most = pair_edges(name)
    assert launches(grad_of(NORMS[name]), fewest - 1, n=n) == 2
    assert launches(grad_of(NORMS[name]), most + 1, n=n) == 2
    if name == "rms_norm":
        assert launches(grad_of(NORMS[name]), fewest, n=n // 2) == 2


def test_small_softmax_derivative_lowers_to_xla():
    """Softmax's fwd+bwd over rows of at most SOFTMAX_DERIVATIVE_N, up to SOFTMAX_BYTES of
    bfloat16 input: no kernel."""
    n = SOFTMAX_DERIVATIVE_N
    softmax = FORWARDS["softmax"][0]
    assert launches(grad_of(softmax), 1, n=n) == 0
    assert launches(grad_of(softmax), SOFTMAX_BYTES // (n * 2), n=n) == 0


@pytest.mark.cutlass
def test_softmax_derivative_keeps_its_kernel_elsewhere():
    """Longer rows, more bytes, log-softmax's derivative: the derivative kernel stays."""
    n = SOFTMAX_DERIVATIVE_N
    softmax = FORWARDS["softmax"][0]
    assert launches(grad_of(softmax), 8, n=n + 256) == 1
    assert launches(grad_of(softmax), SOFTMAX_BYTES // (n * 2) + 1, n=n) == 2
    assert launches(grad_of(quack_jax.log_softmax), 8, n=n) == 1


@pytest.mark.cutlass
@pytest.mark.parametrize("name", ["softmax", "rms_norm", "layer_norm"])
def test_larger_forwards_and_forced_kernels_launch(name):
    fn, most = FORWARDS[name]
    rows = most // (N * 2) + 1
    assert launches(fn, rows) == 1
    assert launches(fn, 1, path="kernel") == 1
    assert launches(fn, rows, path="reference") == 0


def test_lowering_path_rejects_unknown_paths():
    with pytest.raises(ValueError, match="path must be one of"), lowering_path("cuda"):
        pass


def test_lowering_options_nest_and_come_back():
    """A block sets the options it names; the outer ones come back when it ends, also on
    an error."""
    outer = options()
    with lowering(regime="few"):
        few = dataclasses.replace(outer, regime="few")
        with pytest.raises(RuntimeError), lowering(path="reference", one_wave=False):
            assert options() == dataclasses.replace(few, path="reference", one_wave=False)
            raise RuntimeError
        assert options() == few
    assert options() == outer


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "n", "kernels"),
    [("softmax", N, 0), ("softmax", 4 * N, 1), ("rms_norm", N, 2), ("rms_norm", 4 * N, 0)],
)
def test_the_training_path_at_a_small_shape(name, n, kernels):
    """softmax: XLA's forward, then XLA's derivative (rows of 1024) or the backward
    kernel (4096); rms_norm: both kernels (rows of 1024) or both on XLA (4096)."""
    x = np.random.default_rng(7).standard_normal((8, n), np.float32)
    dy = np.random.default_rng(8).standard_normal((8, n), np.float32)
    w = np.linspace(0.5, 1.5, n, dtype=np.float32)

    def loss(x):
        y = quack_jax.softmax(x) if name == "softmax" else quack_jax.rms_norm(x, w)
        return jnp.sum(y * dy)

    with lowering_path("auto"):
        lowered = jax.jit(jax.value_and_grad(loss)).lower(x)
        assert lowered.as_text().count(f"custom_call @{_ffi.TARGET}") == kernels
        value, grad = lowered.compile()(x)
    x64, dy64, w64 = x.astype(np.float64), dy.astype(np.float64), w.astype(np.float64)
    if name == "softmax":
        p = np.exp(x64 - x64.max(-1, keepdims=True))
        y = p / p.sum(-1, keepdims=True)
        want = y * (dy64 - (dy64 * y).sum(-1, keepdims=True))
    else:
        rstd = 1 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6)
        y = x64 * rstd * w64
        g = dy64 * w64
        want = rstd * (g - x64 * rstd**2 * (g * x64).mean(-1, keepdims=True))
    np.testing.assert_allclose(float(value), (y * dy64).sum(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-4, atol=1e-5)
