"""The ``implementation`` argument and ``$QUACK_JAX_IMPLEMENTATION`` of softmax and the
norms: "xla" leaves no quack_jax primitive in the program or its gradient, computes what
the default path does, and bad values raise ValueError naming the argument."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import quack_jax

X = np.random.default_rng(0).standard_normal((3, 40), np.float32)
W = np.linspace(0.5, 1.5, 40, dtype=np.float32)
OPS = {
    "softmax": lambda x, **kw: quack_jax.softmax(x, **kw),
    "log_softmax": lambda x, **kw: quack_jax.log_softmax(x, axis=0, **kw),
    "softmax-where": lambda x, **kw: quack_jax.softmax(x, None, X > -1, **kw),
    "rms_norm": lambda x, **kw: quack_jax.rms_norm(x, W, residual=x * 0.5, **kw),
    "layer_norm": lambda x, **kw: quack_jax.layer_norm(x, W, W, prenorm=True, **kw)[0],
}


def primitives(f, *args):
    """The names of the primitives in ``f``'s jaxpr, nested ones included."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return set(walk(jax.make_jaxpr(f)(*args).jaxpr))


def value_and_grad(op, **kw):
    return jax.value_and_grad(lambda x: jnp.sum(jnp.sin(op(x, **kw)) * W))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("how", ["argument", "environment"])
def test_xla(name, how, monkeypatch):
    op = OPS[name]
    default = value_and_grad(op)(X)
    assert any(p.startswith("quack_jax") for p in primitives(value_and_grad(op), X))
    if how == "argument":
        kw = {"implementation": "xla"}
    else:
        monkeypatch.setenv("QUACK_JAX_IMPLEMENTATION", "xla")
        kw = {}
    for f in (lambda x: op(x, **kw), value_and_grad(op, **kw)):
        found = primitives(f, X)
        assert not [p for p in found if p.startswith("quack_jax")], found
    value, grad = value_and_grad(op, **kw)(X)
    np.testing.assert_allclose(value, default[0], rtol=1e-5)
    np.testing.assert_allclose(grad, default[1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", OPS)
def test_bad_values(name, monkeypatch):
    op, name = OPS[name], name.split("-")[0]
    with pytest.raises(ValueError, match=f"{name}: implementation must be None or 'xla'"):
        op(X, implementation="cuda")
    monkeypatch.setenv("QUACK_JAX_IMPLEMENTATION", "triton")
    with pytest.raises(ValueError, match=f"{name}: .QUACK_JAX_IMPLEMENTATION must be"):
        op(X)
    op(X, implementation="xla")  # the argument wins over the environment
