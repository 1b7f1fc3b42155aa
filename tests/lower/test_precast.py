"""Casting parameters once before deterministic mode's shard loop (tessera/lower/precast.py): which parameters
qualify, and that the train step's bits do not change when they are cast outside the loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tessera.lower import precast

F32 = jax.ShapeDtypeStruct((4, 8), jnp.float32)
STACK = jax.ShapeDtypeStruct((2, 8, 8), jnp.float32)
X = jax.ShapeDtypeStruct((3, 8), jnp.bfloat16)


def _hoist(fn, params):
    return precast.hoistable(fn, params, X)


def test_a_weight_used_once_through_a_cast_qualifies_and_other_uses_do_not():
    def fn(p, x):
        y = x @ p["once"].astype(jnp.bfloat16).T  # the one qualifying use
        y = y + x @ p["twice"].astype(jnp.bfloat16).T + x @ (2 * p["twice"]).astype(jnp.bfloat16).T
        y = y * p["wide"].sum()  # used in fp32
        y = y + x @ p["two_sites"].astype(jnp.bfloat16).T + x @ p["two_sites"].astype(jnp.bfloat16).T
        return jnp.sum(y.astype(jnp.float32) * p["scale"].astype(jnp.float16).sum().astype(jnp.float32))

    got = _hoist(fn, {"once": F32, "twice": F32, "wide": F32, "two_sites": F32, "scale": F32})
    assert got == {"once": jnp.dtype(jnp.bfloat16), "scale": jnp.dtype(jnp.float16)}


def test_a_scanned_stack_qualifies_a_loop_constant_does_not():
    def layers(p, x):
        def body(h, w):  # each iteration reads its own layer once
            return h @ w.astype(jnp.bfloat16), None
        return jnp.sum(jax.lax.scan(body, x, p["stacked"])[0].astype(jnp.float32))

    def shared(p, x):
        def body(h, _):  # one weight read by every iteration: its cotangents add up across them
            return h @ p["shared"][0].astype(jnp.bfloat16), None
        return jnp.sum(jax.lax.scan(body, x, None, length=3)[0].astype(jnp.float32))

    assert _hoist(layers, {"stacked": STACK}) == {"stacked": jnp.dtype(jnp.bfloat16)}
    assert _hoist(shared, {"shared": STACK}) == {}


def test_disjoint_slices_qualify_overlapping_ones_do_not():
    def pairs(p, x):  # a loop body reading two layers of a stack, as GPT-OSS's alternating attention does
        w = p["w"]
        return jnp.sum((x @ w[0].astype(jnp.bfloat16) + x @ w[1].astype(jnp.bfloat16)).astype(jnp.float32))

    def overlap(p, x):
        w = p["w"]
        return jnp.sum((x @ w[0, :, :8].astype(jnp.bfloat16)
                        + x @ w[0, :, :8].astype(jnp.bfloat16)).astype(jnp.float32))

    assert _hoist(pairs, {"w": STACK}) == {"w": jnp.dtype(jnp.bfloat16)}
    assert _hoist(overlap, {"w": STACK}) == {}


def test_through_jit_and_remat_and_gradients_are_the_same_bits():
    inner = jax.jit(lambda w, x: x @ w.astype(jnp.bfloat16))

    @jax.checkpoint
    def fn(p, x):
        return jnp.sum(jnp.tanh(inner(p["w"], x).astype(jnp.float32)))

    params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32)}
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 8)), jnp.bfloat16)
    dtypes = precast.hoistable(fn, params, x)
    assert dtypes == {"w": jnp.dtype(jnp.bfloat16)}
    value, grad = jax.value_and_grad(fn)(params, x)
    value_cast, grad_cast = jax.value_and_grad(fn)(precast.cast(params, dtypes), x)
    assert grad_cast["w"].dtype == jnp.bfloat16
    assert value_cast.tobytes() == value.tobytes()
    assert grad_cast["w"].astype(jnp.float32).tobytes() == grad["w"].tobytes()


def test_through_a_fence_but_no_other_custom_vjp_and_gradients_are_the_same_bits():
    """fenced's VJP is the wrapped function's own, so a cast inside a fenced piece (deterministic mode's head: the
    unembedding's weight) is hoisted; another custom VJP's backward may compute anything and is not seen through."""
    from tessera.lower.fence import fenced

    def fn(p, x):
        return fenced(lambda w, x: jnp.sum(jnp.tanh((x @ w.astype(jnp.bfloat16)).astype(jnp.float32))), p["w"], x)

    @jax.custom_vjp
    def opaque(w, x):
        return x @ w.astype(jnp.bfloat16)

    opaque.defvjp(lambda w, x: (opaque(w, x), (w, x)), lambda r, g: (r[1].T.astype(jnp.float32) @ g.astype(
        jnp.float32), (g @ r[0].T.astype(jnp.bfloat16)).astype(jnp.bfloat16)))
    params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32)}
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 8)), jnp.bfloat16)
    assert precast.hoistable(lambda p, x: jnp.sum(opaque(p["w"], x).astype(jnp.float32)), params, x) == {}
    dtypes = precast.hoistable(fn, params, x)
    assert dtypes == {"w": jnp.dtype(jnp.bfloat16)}
    value, grad = jax.value_and_grad(fn)(params, x)
    value_cast, grad_cast = jax.value_and_grad(fn)(precast.cast(params, dtypes), x)
    assert grad_cast["w"].dtype == jnp.bfloat16 and np.abs(np.asarray(grad["w"])).sum() > 0
    assert value_cast.tobytes() == value.tobytes()
    assert grad_cast["w"].astype(jnp.float32).tobytes() == grad["w"].tobytes()


def test_the_deterministic_train_step_is_bitwise_the_same_with_and_without(monkeypatch):
    """A bf16 Llama with stacked layers under remat, two deterministic steps of 4 canonical shards: the train state
    (parameters and Adam's moments) is the same bits whether the layer weights are cast in the loop or before it."""
    from tessera.lower.program import compile_experiment
    from tessera.run.optim import build_optimizer, current_lr
    from tessera.spec import load_experiment
    from tests.lower.shard.worker import batches

    overrides = {"parallel.deterministic": True, "parallel.remat": "dots", "numerics.default": "bf16 @accum(fp32)",
                 "model.args.layers": 2, "model.args.d_model": 32, "model.args.heads": 4, "model.args.kv_heads": 2,
                 "model.args.head_dim": 8, "model.args.d_ff": 64, "task.batch": 4, "task.seq_len": 8}
    hoisted = []

    def steps():
        exp = load_experiment("specs/llama_tiny.yaml", overrides=overrides)
        prog = compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)
        state = prog.init_train_state(prog.init(0))
        for batch in batches(2, exp.task.batch, exp.task.seq_len):
            state, _ = prog.train_step(state, batch)
        return [np.asarray(leaf) for leaf in jax.tree.leaves((state.params, state.opt_state))]

    real = precast.hoistable
    monkeypatch.setattr(precast, "hoistable", lambda *a: hoisted.append(real(*a)) or hoisted[-1])
    with_precast = steps()
    monkeypatch.setattr(precast, "hoistable", lambda *a: {})
    without = steps()
    assert any("layers/mlp/up" in h for h in hoisted)  # the layer weights were cast before the loop
    assert len(with_precast) == len(without)
    for a, b in zip(with_precast, without):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
