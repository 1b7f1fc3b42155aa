"""A repeat's fp8 weights quantised once before its scan (tessera/lower/fp8_held.py): the products multiply by the
held copies with the numbers of quantising in the product, bit for bit (values, gradients, the amaxes delayed scaling
records), and the scan then quantises only activations and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower import fp8_held
from tessera.lower.program import compile_experiment
from tessera.lower.reference import fp8
from tessera.run.optim import build_optimizer, current_lr
from tessera.spec import load_experiment
from tests.lower.shard.make_snapshots import ROOT


def _equal(a, b) -> bool:
    return jax.tree.all(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b))


@pytest.mark.parametrize("scaling", ["per_tensor", "delayed(4)"])
def test_a_held_weight_gives_the_products_numbers_and_gradients(scaling):
    """x [6, 16] ⊗ w [16, 8] in bf16, random: the product, dx, dw and (delayed) the history's cotangent are the same
    bits whether w is quantised in the product or held (`hold`) beforehand."""
    kx, kw, kh = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(kx, (6, 16), jnp.bfloat16)
    w = (jax.random.normal(kw, (16, 8), jnp.float32) * 0.02).astype(jnp.bfloat16)
    history = jnp.abs(jax.random.normal(kh, (3, 4), jnp.float32)) * jnp.asarray([[3.0], [0.03], [1e-4]])
    delayed = scaling.startswith("delayed")

    def f(x, w, h, held):
        y = fp8.einsum("mk,kn->mn", x, w, accum=jnp.float32, preferred_element_type=jnp.bfloat16, scaling=scaling,
                       history=h if delayed else None, held=held)
        return (y.astype(jnp.float32) * jnp.arange(8, dtype=jnp.float32)).sum(), y

    held = jax.lax.stop_gradient(fp8.hold(w, jnp.bfloat16, history if delayed else None))
    (_, y0), g0 = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, w, history, None)
    (_, y1), g1 = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, w, history, held)
    assert _equal(y0, y1) and _equal(g0, g1)
    assert held[0].dtype == jnp.float8_e4m3fn and float(jnp.abs(g1[1]).max()) > 0
    if delayed:  # the weight's amax is recorded from the held copy's
        assert float(g1[2][1, 0]) == float(jnp.abs(w.astype(jnp.float32)).max())


ARGS = {"d_model": 32, "d_ff": 64, "head_dim": 8, "heads": 4, "kv_heads": 2, "vocab": 64, "layers": 2}


def _step_jaxpr(monkeypatch, hold: bool, **over):
    """The jaxpr of a tiny Llama's train step (2 layers, delayed(4) scaling, remat dots unless `over` says
    otherwise), traced only."""
    if not hold:
        monkeypatch.setattr(fp8_held, "holds", lambda ctx: False)
    over = {"numerics.default": "fp8_e4m3 @scale(delayed(4))", "task.batch": 2, "task.seq_len": 8,
            "parallel.remat": "dots", **{f"model.args.{k}": v for k, v in ARGS.items()}, **over}
    exp = load_experiment(str(ROOT / "specs" / "llama_tiny.yaml"), overrides=over)
    prog = compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)
    seq = jnp.ones((2, 8), jnp.int32)
    batch = {"tokens": seq, "targets": seq, "mask": jnp.ones((2, 8), jnp.float32)}
    state = jax.eval_shape(lambda: prog.init_train_state(prog.init(0)))
    jaxpr = jax.make_jaxpr(prog.train_step_fn())(state, batch).jaxpr
    monkeypatch.undo()
    return jaxpr


def _e4m3_casts(jaxpr, in_loop=False, out=None, seen=None) -> dict:
    """{inside a loop: count} of the casts to e4m3 in `jaxpr` and every jaxpr its equations hold, each jaxpr once; a
    loop is a scan or a fast-mode step's unrolled layer (a call named `layer`, the same jaxpr for every layer)."""
    out = {True: 0, False: 0} if out is None else out
    seen = set() if seen is None else seen
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == jnp.float8_e4m3fn:
            out[in_loop] += 1
        loop = in_loop or eqn.primitive.name == "scan" or "layer" in str(eqn.params.get("name", ""))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns") and id(sub) not in seen:
                    seen.add(id(sub))
                    _e4m3_casts(sub, loop, out, seen)
    return out


@pytest.mark.parametrize("over", [
    {"parallel.deterministic": False},  # remat dots: the unrolled layer, its forward and remat's replay of it
    {"parallel.deterministic": True, "task.batch": 8, "parallel.remat": "none",  # one device's shard loop over 8
     "numerics.default": "fp8_e4m3 @scale(per_tensor)"}])                      # canonical shards, layers unrolled
def test_the_loops_cast_only_activations(monkeypatch, over):
    """Held, a train step's loops (the layers, unrolled; deterministic mode's loop over canonical shards) cast only
    activations to e4m3, each of the seven weights outside them, once; quantised in the products, the loops cast
    each weight as often as its product's activation. (That the steps are the same bits: tests/lower/test_fp8_delayed.py and, in
    deterministic mode, test_a_deterministic_step_holds_its_weights_before_the_shard_loop below.)"""
    held, plain = _e4m3_casts(_step_jaxpr(monkeypatch, True, **over)), _e4m3_casts(_step_jaxpr(monkeypatch, False, **over))
    if over["parallel.deterministic"]:  # per_tensor: each product casts its activation (and, plain, its weight)
        assert held[True] >= 7 and plain[True] == 2 * held[True]
    else:  # delayed: the MLP's gate and up share one cast of x (tessera/lower/fp8_mlp.py): 6 activations, in the
        # forward and in remat's replay, and plain the 7 weights as often
        assert held[True] == 2 * 6 and plain[True] == held[True] + 2 * 7
    assert held[False] == 7 and plain[False] == 0


def _weight_products(jaxpr, out=None) -> list:
    """(lhs dtype, whether the e4m3 rhs's contracted dims are its minor ones) of every dot_general in `jaxpr` (and
    every jaxpr its equations hold) whose rhs is an e4m3 weight: the forward products (lhs e4m3) and the backward's
    input gradients (lhs e5m2)."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and eqn.invars[1].aval.dtype == jnp.float8_e4m3fn:
            (_, rc), _ = eqn.params["dimension_numbers"]
            nd = eqn.invars[1].aval.ndim
            out.append((eqn.invars[0].aval.dtype, sorted(rc) == list(range(nd - len(rc), nd))))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _weight_products(sub, out)
    return out


def test_the_shard_loop_reads_each_weight_in_its_products_layout(monkeypatch):
    """Deterministic mode on one device holds each fp8 weight in both layouts its products read, so every product
    with a weight — forward (e4m3 activations) and input gradient (e5m2) — contracts the weight's minor dims, the
    form cuBLASLt's fp8 GEMM takes without XLA:GPU transposing the weight in every shard (session 44's profile of
    the Llama-1B step at C = 8: 896 such transposes a step). The fast step's scan keeps one layout (its forward
    reads the weight's leading dims)."""
    det = {"parallel.deterministic": True, "task.batch": 8, "parallel.remat": "none",
           "numerics.default": "fp8_e4m3 @scale(per_tensor)"}
    products = _weight_products(_step_jaxpr(monkeypatch, True, **det))
    forward = [minor for dtype, minor in products if dtype == jnp.float8_e4m3fn]
    backward = [minor for dtype, minor in products if dtype == jnp.float8_e5m2]
    assert len(forward) == len(backward) == 7 * 2 and all(forward) and all(backward)
    fast = _weight_products(_step_jaxpr(monkeypatch, True, **{"parallel.deterministic": False}))
    assert not any(minor for dtype, minor in fast if dtype == jnp.float8_e4m3fn)
