"""The one-step gradient (`grad = last`, HRM's approximation) on a weight-shared repeat and on a loop: the values of
every step, and the gradient of one step applied to the stop-gradient'ed state the steps before it reached, as
its definition says; an input every step reads (carried unchanged) keeps its gradient. Training keeps one step's
residuals whatever the depth."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # the list jax.ad_checkpoint.print_saved_residuals prints

from tessera.ir import cost, parse_graph, verify
from tessera.ir.elaborate import build_graph
from tessera.ir.printer import print_graph
from tessera.lower.context import LowerCtx
from tessera.lower.interpret import eval_region

sg = jax.lax.stop_gradient

# h is the state; x, carried unchanged, is an input every step reads (its gradient comes through the last step)
REPEAT = """
model osg(width: int = 4, n: int = 4) {
  block step(h: [points, hidden], x: [points, hidden]) {
    y = linear(h, [hidden_out = width], over = [hidden], bias = true)
    return tanh(rename(y, hidden_out, hidden) + x), x
  }
  forward(x: f32[points, hidden = width]) {
    h, u = repeat(n, step, x, x, shared = true, grad = last) as cell
    return h
  }
}
"""

# the same step in a loop that stops each point when its counter c turns positive (before a step)
LOOP = """
model osl(width: int = 4, cap: int = 5) {
  block step(h: [points, hidden], x: [points, hidden], c: [points], one: [points]) {
    y = linear(h, [hidden_out = width], over = [hidden], bias = true)
    return tanh(rename(y, hidden_out, hidden) + x), x, c + one, one
  }
  block halt(h: [points, hidden], x: [points, hidden], c: [points], one: [points]) {
    return c
  }
  forward(x: f32[points, hidden = width], c: f32[points], one: f32[points]) {
    h, u, k, o = loop(step, x, x, c, one, until = halt, max = cap, grad = last) as cell
    return h
  }
}
"""


def _graph(tmp_path, text, **args):
    path = tmp_path / "m.tsl"
    path.write_text(text)
    return build_graph(path, args)


def _params(graph):
    rng = np.random.default_rng(0)
    return {p.path: jnp.asarray(rng.standard_normal([d.size for d in p.type.dims]) * 0.5, jnp.float32)
            for p in graph.params.values()}


def _step(p, h, x):
    return jnp.tanh(h @ p["cell/linear/weight"] + p["cell/linear/bias"] + x)


def _one_step(p, x, steps):
    """The definition: steps - 1 steps without gradient (stop_gradient on their inputs and weights), then one with
    it at the state they reached; no step at all leaves the input as it is."""
    if steps == 0:
        return x
    h = sg(x)
    for _ in range(steps - 1):
        h = _step(sg(p), h, sg(x))
    return _step(p, sg(h), x)


def _full(p, x, steps):
    h = x
    for _ in range(steps):
        h = _step(p, h, x)
    return h


def _grads(f, params, x, probe):
    return jax.jit(jax.grad(lambda p, x: jnp.sum(f(p, x) * probe), argnums=(0, 1)))(params, x)


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


# unroll: as deterministic mode's shard loop lowers a train step (its stacked layers unrolled): a weight-shared
# repeat stays a scan with its one-step gradient
@pytest.mark.parametrize("mode,unroll", [("train", False), ("forward", False), ("train", True)])
def test_repeat_gradient_is_one_step_at_the_stopped_state(tmp_path, mode, unroll):
    graph = _graph(tmp_path, REPEAT)
    params = _params(graph)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 4)), jnp.float32)
    probe = jnp.asarray(np.random.default_rng(2).standard_normal((5, 4)), jnp.float32)

    def run(p, x):
        (h,), _ = eval_region(graph.body, [x], p, LowerCtx(mode=mode, unroll=unroll))
        return h

    np.testing.assert_allclose(run(params, x), _full(params, x, 4), rtol=1e-5, atol=1e-6)  # every step's value
    got = _grads(run, params, x, probe)
    _close(got, _grads(lambda p, x: _one_step(p, x, 4), params, x, probe))
    full = _grads(lambda p, x: _full(p, x, 4), params, x, probe)
    assert not np.allclose(got[1], full[1], rtol=1e-3)  # not the full gradient: the test tells them apart
    assert float(jnp.abs(got[1]).max()) > 0  # x, read by the last step, keeps a gradient


def test_loop_gradient_is_each_points_last_step(tmp_path):
    """Points that halt before any step, after some (their last step is run again with the gradient) and at the
    cap (the last step runs after the masked ones)."""
    graph = _graph(tmp_path, LOOP)
    params = _params(graph)
    c = jnp.asarray([0.5, -0.5, -2.5, -9.0, -1.5], jnp.float32)
    steps = [0, 1, 3, 5, 2]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 4)), jnp.float32)
    probe = jnp.asarray(np.random.default_rng(2).standard_normal((5, 4)), jnp.float32)

    def run(p, x):
        (h,), _ = eval_region(graph.body, [x, c, jnp.ones(5, jnp.float32)], p, LowerCtx(mode="train"))
        return h

    def rows(f):
        return lambda p, x: jnp.stack([f(p, x[r], k) for r, k in enumerate(steps)])

    np.testing.assert_allclose(run(params, x), rows(_full)(params, x), rtol=1e-5, atol=1e-6)
    _close(_grads(run, params, x, probe), _grads(rows(_one_step), params, x, probe))


def _residual_bytes(graph, inputs, mode="train"):
    params = _params(graph)

    def loss(p, x):
        (h,), _ = eval_region(graph.body, [x, *inputs], p, LowerCtx(mode=mode))
        return jnp.sum(h)

    x = jnp.ones((5, 4), jnp.float32)
    return sum(a.size * a.dtype.itemsize for a, _ in saved_residuals(loss, params, x))


@pytest.mark.parametrize("text, inputs, depth", [
    (REPEAT, [], "n"),
    (LOOP, [jnp.full(5, -30.0), jnp.ones(5)], "cap"),
])
def test_training_memory_does_not_grow_with_depth(tmp_path, text, inputs, depth):
    """The residuals the backward pass keeps: as many bytes at depth 16 as at depth 2 under the one-step gradient;
    with every step's gradient they grow with the depth."""
    last = {d: _residual_bytes(_graph(tmp_path, text, **{depth: d}), inputs) for d in (2, 16)}
    assert last[2] == last[16] > 0
    every = text.replace(", grad = last", "")
    full = {d: _residual_bytes(_graph(tmp_path, every, **{depth: d}), inputs) for d in (2, 16)}
    assert full[16] > full[2] > last[2]


def test_the_one_step_gradient_round_trips_through_the_ir(tmp_path):
    for text in (REPEAT, LOOP):
        printed = print_graph(_graph(tmp_path, text))
        assert 'grad = "last"' in printed and print_graph(verify(parse_graph(printed))) == printed


# HRM's two modules: a fast low-level step T times per slow high-level step, N cycles, both one-step gradients
HRM = """
model hrm(width: int = 4, cycles: int = 3, steps: int = 2) {
  block low(zl: [points, hidden], zh: [points, hidden], x: [points, hidden]) {
    y = linear(zl + zh + x, [hidden_out = width], over = [hidden], bias = true)
    return tanh(rename(y, hidden_out, hidden)), zh, x
  }
  block cycle(zl: [points, hidden], zh: [points, hidden], x: [points, hidden]) {
    zl, zh, x = repeat(steps, low, zl, zh, x, shared = true, grad = last) as low
    y = linear(zh + zl, [hidden_out = width], over = [hidden], bias = true) as high
    return zl, tanh(rename(y, hidden_out, hidden)), x
  }
  forward(x: f32[points, hidden = width], zl: f32[points, hidden = width], zh: f32[points, hidden = width]) {
    zl, zh, x = repeat(cycles, cycle, zl, zh, x, shared = true, grad = last) as hrm
    return zh
  }
}
"""


def _hrm_reference(p, x, zl, zh, cycles=3, steps=2):
    """HRM's one-step gradient as its paper writes it: N * T - 1 low steps (and the high steps between them)
    without gradient, then one low step and one high step with it."""
    def low(p, zl, zh, x):
        return jnp.tanh((zl + zh + x) @ p["hrm/low/linear/weight"] + p["hrm/low/linear/bias"])

    def high(p, zh, zl):
        return jnp.tanh((zh + zl) @ p["hrm/high/weight"] + p["hrm/high/bias"])

    zl, zh = sg(zl), sg(zh)
    for i in range(cycles * steps - 1):
        zl = low(sg(p), zl, zh, sg(x))
        if (i + 1) % steps == 0:
            zh = high(sg(p), zh, zl)
    zl = low(p, sg(zl), sg(zh), x)
    return high(p, sg(zh), zl)


def test_nested_one_step_gradients_are_hrms(tmp_path):
    """A one-step repeat of cycles holding a one-step repeat of low steps: HRM's gradient, through the last low
    step and the last high step only."""
    graph = _graph(tmp_path, HRM)
    params = _params(graph)
    rng = np.random.default_rng(1)
    x, zl, zh = (jnp.asarray(rng.standard_normal((5, 4)), jnp.float32) for _ in range(3))
    probe = jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)

    def run(p, x):
        (h,), _ = eval_region(graph.body, [x, zl, zh], p, LowerCtx(mode="train"))
        return h

    np.testing.assert_allclose(run(params, x), _hrm_reference(params, x, zl, zh), rtol=1e-5, atol=1e-6)
    got = _grads(run, params, x, probe)
    _close(got, _grads(lambda p, x: _hrm_reference(p, x, zl, zh), params, x, probe))
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(got))


def test_the_plan_counts_the_backward_of_one_step(tmp_path):
    """`tessera plan`'s model: the forward runs every step, the backward pass and the saved activations one."""
    sizes = {"points": 5}

    def plan(text, n):
        graph = _graph(tmp_path, text, n=n)
        train = cost.train_flops(cost.flop_counts(graph, sizes))
        return train["forward"], train["train_step"] - train["forward"], cost.activation_bytes(graph, sizes, "none")

    (f2, b2, a2), (f16, b16, a16) = plan(REPEAT, 2), plan(REPEAT, 16)
    assert f16 > f2 and b16 == b2 > 0 and a16 == a2 and a2["layers"] == 1
    every = REPEAT.replace(", grad = last", "")
    (_, e2, _), (_, e16, full16) = plan(every, 2), plan(every, 16)
    assert e2 == 2 * b2 and e16 == 16 * b2 and full16["layers"] == 16
