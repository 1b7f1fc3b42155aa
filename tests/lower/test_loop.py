"""`loop(block, x..., until = halt, max = N)`: equal to plain Python loops that stop each entry when its halting
predicate turns positive (values and gradients), a while loop at inference that skips the steps after every entry
has halted (counted), the same values from the masked scan training runs, its IR round trip and its FLOPs at the
cap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.ir import parse_graph, verify
from tessera.ir.elaborate import build_graph
from tessera.ir.flops import graph_flops, op_flops
from tessera.ir.passes import PassContext, stages
from tessera.ir.printer import print_graph
from tessera.lower import table
from tessera.lower.context import LowerCtx
from tessera.lower.interpret import eval_region
from tests.ir.conftest import POLICY

# a state h per point, a counter c that grows by one a step, and a learned halting head q: a point halts (before
# a step) once c + q(h) > 0, so how many steps each point takes depends on its data and on the weights
MODEL = """
model lp(width: int = 4, cap: int = 6) {
  block step(h: [points, hidden], c: [points], one: [points]) {
    y = linear(h, [hidden_out = width], over = [hidden], bias = true)
    return tanh(rename(y, hidden_out, hidden)), c + one, one
  }
  block halt(h: [points, hidden], c: [points], one: [points]) {
    q = linear(h, [q = 1], over = [hidden])
    return c + sum(q, over = [q])
  }
  forward(x: f32[points, hidden = width], c: f32[points], one: f32[points]) {
    h, steps, o = loop(step, x, c, one, until = halt, max = cap) as cell
    return h, steps
  }
}
"""
CAP = 6


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("loop") / "lp.tsl"
    path.write_text(MODEL)
    return build_graph(path, {})


def _params(graph, head=1.0):
    rng = np.random.default_rng(0)
    params = {p.path: jnp.asarray(rng.standard_normal([d.size for d in p.type.dims]) * 0.5, jnp.float32)
              for p in graph.params.values()}
    params["cell/halt/linear/weight"] = params["cell/halt/linear/weight"] * head
    return params


COUNTERS = [-2.1, 0.5, -0.9, -20.0, -3.1, -1.9, -2.9, -0.1]


def _inputs(c):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((len(c), 4)), jnp.float32)
    return x, jnp.asarray(c, jnp.float32), jnp.ones(len(c), jnp.float32)


def _run(graph, mode):
    @jax.jit
    def run(p, x, c, one):
        (h, steps), _ = eval_region(graph.body, [x, c, one], p, LowerCtx(mode=mode))
        return h, steps
    return run


def _plain_steps(params, x, c):
    """How many steps each point takes, by a plain Python loop on concrete numbers."""
    w, b, wq = (np.asarray(params[k]) for k in ("cell/linear/weight", "cell/linear/bias", "cell/halt/linear/weight"))
    steps = []
    for h, cc in zip(np.asarray(x), np.asarray(c)):
        k = 0
        while k < CAP and not cc + float((h @ wq).sum()) > 0:
            h, cc, k = np.tanh(h @ w + b), cc + 1, k + 1
        steps.append(k)
    return steps


def _plain(params, x, steps):
    """The recurrence as a Python loop: point r takes steps[r] steps of the one weight."""
    w, b = params["cell/linear/weight"], params["cell/linear/bias"]
    rows = []
    for r, k in enumerate(steps):
        h = x[r]
        for _ in range(k):
            h = jnp.tanh(h @ w + b)
        rows.append(h)
    return jnp.stack(rows)


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_each_point_stops_when_its_predicate_turns_positive(graph, mode):
    """Points halting before any step, after some and never (the cap): the while loop (forward) and the masked
    scan (train) give the plain loop's values, each point's counter telling its steps."""
    params = _params(graph, head=4.0)
    x, c, one = _inputs(COUNTERS)
    steps = _plain_steps(params, x, c)
    by_counter = [min(CAP, max(0, int(np.floor(-v)) + 1)) for v in COUNTERS]  # with the head's weights at 0
    assert steps[1] == 0 and steps[3] == CAP and steps != by_counter  # the head's output moves the halting
    h, counter = _run(graph, mode)(params, x, c, one)
    np.testing.assert_allclose(h, _plain(params, x, steps), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(counter, np.asarray(c) + np.asarray(steps), rtol=1e-6)


def test_the_gradient_of_the_masked_scan_is_the_plain_loops(graph):
    params = _params(graph, head=4.0)
    x, c, one = _inputs(COUNTERS)
    steps = _plain_steps(params, x, c)
    probe = jnp.asarray(np.random.default_rng(2).standard_normal(x.shape), jnp.float32)
    run = _run(graph, "train")
    got_p, got_x = jax.grad(lambda p, x: jnp.sum(run(p, x, c, one)[0] * probe), argnums=(0, 1))(params, x)
    want_p, want_x = jax.jit(jax.grad(lambda p, x: jnp.sum(_plain(p, x, steps) * probe), argnums=(0, 1)))(params, x)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-4, atol=1e-6)
    for path in ("cell/linear/weight", "cell/linear/bias"):
        np.testing.assert_allclose(got_p[path], want_p[path], rtol=1e-4, atol=1e-6, err_msg=path)
    assert float(jnp.abs(got_p["cell/linear/weight"]).max()) > 0
    assert float(jnp.abs(got_p["cell/halt/linear/weight"]).max()) == 0.0  # a halting decision has no gradient


def test_a_loop_that_stops_early_skips_the_remaining_steps_at_inference(graph, monkeypatch):
    """tanh runs once a step; a callback inside it counts the steps run: 3 of the cap of 6 at inference (every
    point halts after 3), all 6 in training's masked scan, with the same values."""
    ran = []
    plain_tanh = table.get_lowering("tanh")

    def counted(ctx, op, attrs, ins, local):
        jax.debug.callback(lambda: ran.append(1))
        return plain_tanh.fn(ctx, op, attrs, ins, local)

    monkeypatch.setitem(table.LOWERINGS, "tanh", table.Lowering("tanh", counted))
    params = _params(graph, head=0.0)  # the predicate is the counter: -2.5 + 3 > 0 after 3 steps
    x, c, one = _inputs([-2.5, -2.5, -2.5])
    h_forward, _ = _run(graph, "forward")(params, x, c, one)
    jax.effects_barrier()
    assert len(ran) == 3
    ran.clear()
    h_train, _ = _run(graph, "train")(params, x, c, one)
    jax.effects_barrier()
    assert len(ran) == CAP
    np.testing.assert_allclose(h_forward, h_train, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(h_forward, _plain(params, x, [3, 3, 3]), rtol=1e-5, atol=1e-6)


def test_the_loop_round_trips_through_its_ir_text(graph):
    text = print_graph(graph)
    assert 'loop(%x, %c, %one) {max = 6, grad = "all"} ^(%h : f32[points, hidden=4]' in text
    assert "} until ^(%h.1 : f32[points, hidden=4], %c.2 : f32[points], %one.2 : f32[points]) {" in text
    assert "@cell/halt/linear/weight" in text  # the halting block's params under the loop's scope
    assert print_graph(verify(parse_graph(text))) == text


def test_flops_count_the_loop_at_its_cap(graph, tmp_path):
    """The body counts `max` times and the predicate `max + 1` (before each step and after the last)."""
    loop = next(op for op in graph.body.ops if op.name == "loop")
    sizes = {"points": 8}
    body = sum(op_flops(o, graph, sizes) for o in loop.region.ops)
    until = sum(op_flops(o, graph, sizes) for o in loop.second.ops)
    assert body > 0 and until > 0
    assert graph_flops(graph, sizes) == CAP * body + (CAP + 1) * until
    path = tmp_path / "lp.tsl"
    path.write_text(MODEL)
    assert graph_flops(build_graph(path, {"cap": 2}), sizes) == 2 * body + 3 * until


@pytest.mark.parametrize("policy", [None, POLICY], ids=["no-policy", "bf16-mxfp4"])
def test_every_pass_keeps_the_loop_valid(graph, policy):
    """The pipeline (canonicalize, decompose, fuse, numerics, shard) walks both regions: every stage verifies and
    round-trips; under bf16 the carried state, both regions' arguments and the predicate follow."""
    for name, g in stages(graph, PassContext(numerics=policy)):
        text = print_graph(g)
        assert print_graph(verify(parse_graph(text))) == text, name
    loop = next(op for op in g.body.ops if op.name == "loop")
    want = "bf16" if policy else "f32"
    assert {a.type.dtype for a in loop.region.args + loop.second.args} == {want}
    assert loop.second.outputs[0].type.dtype == want
