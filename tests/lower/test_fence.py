"""`fenced`: fn as a conditional of its own, differentiated as fn is, its forward returning no input as a residual."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tessera.lower.fence import fenced


def _layer(w, x, t):
    """A weight read by a GEMM (its backward needs w and x), an integer input and an integer output."""
    return jnp.tanh(x @ w) * t[:, None], jnp.sum(t)


def _loss(run):
    return lambda w, x: (lambda o: (o[0] ** 2).sum() + o[1])(run(w, x))


def _inputs():
    r = np.random.default_rng(0)
    return (jnp.asarray(r.normal(size=(16, 8)), jnp.float32), jnp.asarray(r.normal(size=(2, 16)), jnp.float32),
            jnp.array([1, 2], jnp.int32))


def test_a_fenced_layer_has_the_layers_gradients():
    w, x, t = _inputs()
    got = jax.grad(_loss(lambda w, x: fenced(_layer, w, x, t)), argnums=(0, 1))(w, x)
    want = jax.grad(_loss(lambda w, x: _layer(w, x, t)), argnums=(0, 1))(w, x)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(got[0]).sum()) > 1.0
    assert int(jax.jit(lambda w, x: fenced(_layer, w, x, t))(w, x)[1]) == 3


def test_a_fenced_layer_skipped_has_zero_gradients():
    w, x, t = _inputs()
    grads = jax.grad(_loss(lambda w, x: fenced(_layer, w, x, t, when=x[0, 0] > 100)), argnums=(0, 1))(w, x)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in grads)


def test_the_forward_conditional_returns_no_input_as_a_residual():
    """The backward reads w and x where they are: returned by the forward's conditional, each would be copied (a
    conditional's result is a buffer of its own)."""
    w, x, t = _inputs()
    jaxpr = jax.make_jaxpr(jax.grad(_loss(lambda w, x: fenced(_layer, w, x, t)), argnums=(0, 1)))(w, x).jaxpr
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 2  # the forward, then the backward
    forward_out = {v.aval.shape for v in conds[0].outvars}
    assert w.shape not in forward_out and x.shape not in forward_out
    assert {v.aval.shape for v in conds[1].outvars} == {w.shape, x.shape}  # the backward returns their gradients
