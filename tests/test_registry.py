"""An op is declared once: the toy family in ``tests/l2_norm/`` (one folder) plus one line in
``_registry.FAMILIES`` reaches build (also of the kernel op that a missing cubin's error
names), bench and the test grid, and its kernel runs on a GPU, with no other file edited."""

import jax
import jax.numpy as jnp
import pytest
from checks import assert_close, grid, key_for, run

from quack_jax import _cache, _registry, bench, build
from quack_jax._tiling import choose_tiling

FAMILY = "l2_norm"  # tests/l2_norm


def register():
    """The one registry line, as a new op would add it."""
    if FAMILY not in _registry.FAMILIES:
        _registry.FAMILIES.append(FAMILY)


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.setattr(_registry, "FAMILIES", list(_registry.FAMILIES))
    register()


with pytest.MonkeyPatch.context() as patch:  # the grid, read while the family is registered
    patch.setattr(_registry, "FAMILIES", [*_registry.FAMILIES, FAMILY])
    GRID = grid("l2_norm")


def family():
    """The toy family's module (imported once the test has put its folder on the path)."""
    import l2_norm

    return l2_norm


def l2_norm(x):
    return family().l2_norm(x)


def test_every_tool_sees_the_new_op():
    assert _registry.specs()["l2_norm"].ops == ("l2_norm",)
    assert _registry.kernel_configs()["l2_norm_fwd"].__name__ == "L2NormConfig"
    assert _registry.public_ops("l2_norm_fwd") == ("l2_norm",)
    assert "l2_norm" in bench.benchmarks()
    command = _cache.build_command(
        "l2_norm_fwd", "float32", choose_tiling(family().TILINGS, 1000, 4), "sm_90a"
    )
    assert "--ops l2_norm_fwd " in command
    assert {p.values[0] for p in grid("l2_norm")} == {"cpu", "gpu"}


def test_the_new_op_has_its_own_tilings_and_rule():
    """Its tiling family and its kernel-or-XLA rule are its own: declared in its folder,
    taken by the tiling choice and by the default lowering for CUDA (a single short row on
    XLA's formulation; a lowering that launched the kernel would need its cubin)."""
    assert choose_tiling(family().TILINGS, 1000, 4).tag == "t32x128c1v4"
    x = jax.ShapeDtypeStruct((1, family().SMALL), jnp.float32)
    assert "custom_call" not in build.lower_for_cuda(l2_norm, (x,), path="auto")


@pytest.mark.cutlass
def test_the_new_rule_keeps_the_kernel_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("QUACK_JAX_CACHE", str(tmp_path))
    for shape in ((2, family().SMALL), (1, family().SMALL + 1)):
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
        assert "custom_call" in build.lower_for_cuda(l2_norm, (x,), path="auto"), shape


def test_bench_runs_the_new_op(capsys):
    bench.main(["--ops", "l2_norm", "--quick", "--dtypes", "float32", "--reps", "1"])
    assert "| float32 | 64 x 1000 |" in capsys.readouterr().out


@pytest.mark.cutlass
def test_build_compiles_the_new_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("QUACK_JAX_CACHE", str(tmp_path))
    build.main(["--ops", "l2_norm", "--dtypes", "bfloat16", "--sizes", "1000", "65536"])
    assert len(list(tmp_path.glob("l2_norm_fwd-bfloat16-*.json"))) == 2


@pytest.mark.parametrize(("backend", "m", "n", "dtype"), GRID)
def test_values_match_float64(backend, m, n, dtype):
    x = (3.0 * jax.random.normal(key_for("l2", m, n, dtype), (m, n))).astype(dtype)
    y = run(backend, l2_norm, x, launches=1)
    with jax.enable_x64(True):
        x64 = x.astype(jnp.float64)
        ref = x64 / jnp.sqrt(jnp.sum(x64 * x64, axis=-1, keepdims=True) + 1e-6)
        mag = jnp.abs(ref) + jnp.max(jnp.abs(ref), axis=-1, keepdims=True)
    assert_close(y, ref, mag, dtype, f"l2_norm {m}x{n}", x=x)
