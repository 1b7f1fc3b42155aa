"""Deep supervision and adaptive computation time (ACT), as models/hrm.tsl writes them: segments of a recurrence in a
`loop` whose `until` is q_halt - q_continue, the state detached between segments, and a loss entry that adds every
segment's cross-entropy and Q-learning terms per sample.

On a tiny model of the same construction (a tanh cell for HRM's modules, the one-step gradient inside a segment),
the loss entry's terms and gradient equal a plain-JAX loop over segments that halts each sample when its q_halt
first exceeds its q_continue (values and gradients), and the Q terms equal a numpy computation. On models/hrm.tsl,
inference runs only the segments it needs (counted) while training's masked scan runs them all."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.ir import parse_graph, print_graph, verify
from tessera.ir.elaborate import build_graph
from tessera.lower import table
from tessera.lower.context import LowerCtx
from tessera.lower.interpret import eval_region

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
SEGMENTS, STEPS, WIDTH, VOCAB, CELLS = 4, 2, 4, 5, 3

MODEL = """
model ds(width: int = 4, vocab: int = 5, cells: int = 3, steps: int = 2, segments: int = 4) {
  block cell(z: [batch, cell, hidden], x: [batch, cell, hidden]) {
    y = linear(z + x, [hidden_out = width], over = [hidden], bias = true)
    return tanh(rename(y, hidden_out, hidden)), x
  }
  block reason(z: [batch, cell, hidden], x: [batch, cell, hidden]) {
    return repeat(steps, cell, stop_gradient(z), x, shared = true, grad = last) as net
  }
  block q_values(z: [batch, cell, hidden]) {
    q = linear(mean(z, over = [cell]), [act = 2], over = [hidden], bias = true) as q
    return take(q, act, 0), take(q, act, 1)
  }
  block segment(z: [batch, cell, hidden], x: [batch, cell, hidden], q_halt: [batch], q_continue: [batch]) {
    z, x = reason(z, x)
    q_halt, q_continue = q_values(z)
    return z, x, q_halt, q_continue
  }
  block halt(z: [batch, cell, hidden], x: [batch, cell, hidden], q_halt: [batch], q_continue: [batch]) {
    return q_halt - q_continue
  }
  forward(x: f32[batch, cell = cells, hidden = width]) {
    q = mean(x * 0.0, over = [cell, hidden])
    z, x, qh, qc = loop(segment, x * 0.0, x, q, q, until = halt, max = segments) as act
    return linear(z, [vocab = vocab], over = [hidden]) as act/out
  }
  block supervised(z: [batch, cell, hidden], x: [batch, cell, hidden], y: [batch, cell], q_halt: [batch],
                   q_continue: [batch], one: [batch], seen: [batch], k: [batch], lm: [batch], lh: [batch],
                   lc: [batch]) {
    z, x = reason(z, x)
    qh, qc = q_values(z)
    logits = linear(z, [vocab = vocab], over = [hidden]) as out
    target = stop_gradient(sigmoid(maximum(qh, qc)))
    lm = lm + mean(token_cross_entropy(logits, y), over = [cell])
    lh = lh + softplus(qh) - qh * exact_match(logits, y, over = [cell])
    lc = lc + seen * (softplus(q_continue) - q_continue * target)
    return z, x, y, qh, qc, one, one, k + one, lm, lh, lc
  }
  block stop(z: [batch, cell, hidden], x: [batch, cell, hidden], y: [batch, cell], q_halt: [batch],
             q_continue: [batch], one: [batch], seen: [batch], k: [batch], lm: [batch], lh: [batch], lc: [batch]) {
    return q_halt - q_continue
  }
  loss supervision(x: f32[batch, cell = cells, hidden = width], targets: i32[batch, cell = cells])
      -> lm, q_halt, q_continue, segments {
    z = mean(x * 0.0, over = [cell, hidden])
    h, x, y, qh, qc, one, seen, k, lm, lh, lc = loop(supervised, x * 0.0, x, targets, z, z, exp(z), z, z, z, z, z,
                                                     until = stop, max = segments) as act
    return mean(lm * (1.0 / segments), over = [batch]), mean(lh * (1.0 / segments), over = [batch]),
           mean(lc * (1.0 / segments), over = [batch]), mean(k, over = [batch])
  }
}
"""
WEIGHTS = {"lm": 1.0, "q_halt": 0.5, "q_continue": 0.5, "segments": 0.0}
NET, Q, OUT = "act/reason/net/linear", "act/q_values/q", "act/out"


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds.tsl"
    path.write_text(MODEL)
    return build_graph(path, {})


def _params(graph):
    """Random weights; the Q-head's large enough that samples halt after different numbers of segments."""
    rng = np.random.default_rng(5)  # chosen so that the samples below halt after 1, 2, 3 and 4 segments
    params = {p.path: jnp.asarray(rng.standard_normal([d.size for d in p.type.dims]) * 0.7, jnp.float32)
              for p in graph.params.values()}
    params[f"{Q}/weight"] = params[f"{Q}/weight"] * 6.0
    return params


def _data(batch=12):
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((batch, CELLS, WIDTH)), jnp.float32)
    return x, jnp.asarray(rng.integers(0, VOCAB, (batch, CELLS)), jnp.int32)


def _terms(graph, params, x, y):
    (loss,) = graph.losses
    values, _ = eval_region(loss.region, [x, y], params, LowerCtx(mode="train"))
    return dict(zip(loss.terms, values))


def _plain(params, x, y):
    """The definition, in plain JAX: segment m of a sample still running takes the state it reached, detached, runs
    STEPS cell steps (the gradient through the last only), reads logits and (q_halt, q_continue) from it, and adds
    its losses; the sample halts once q_halt > q_continue. Returns (terms, segments run per sample)."""
    sg = jax.lax.stop_gradient
    w, b = params[f"{NET}/weight"], params[f"{NET}/bias"]
    cell = lambda z, w, b: jnp.tanh(jnp.einsum("bch,ho->bco", z + x, w) + b)  # noqa: E731
    softplus = jax.nn.softplus
    batch = x.shape[0]
    z = jnp.zeros_like(x)
    qh_prev = qc_prev = jnp.zeros(batch)
    running, seen = jnp.ones(batch, bool), jnp.zeros(batch)
    lm = lh = lc = runs = jnp.zeros(batch)
    for _ in range(SEGMENTS):
        zs = sg(z)
        for _ in range(STEPS - 1):
            zs = sg(cell(zs, sg(w), sg(b)))
        z_new = cell(zs, w, b)                                       # w's gradient through the last step only
        q = z_new.mean(axis=1) @ params[f"{Q}/weight"] + params[f"{Q}/bias"]
        qh, qc = q[:, 0], q[:, 1]
        logits = jnp.einsum("bch,hv->bcv", z_new, params[f"{OUT}/weight"])
        ce = (jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[..., None], -1)[..., 0]).mean(axis=1)
        right = jnp.all(jnp.argmax(logits, -1) == y, axis=1).astype(jnp.float32)
        target = sg(jax.nn.sigmoid(jnp.maximum(qh, qc)))
        on = running.astype(jnp.float32)
        lm = lm + on * ce
        lh = lh + on * (softplus(qh) - qh * right)
        lc = lc + on * seen * (softplus(qc_prev) - qc_prev * target)  # the previous segment's q_continue
        runs = runs + on
        z = jnp.where(running[:, None, None], z_new, z)
        qh_prev, qc_prev = jnp.where(running, qh, qh_prev), jnp.where(running, qc, qc_prev)
        seen = jnp.where(running, 1.0, seen)
        running = running & ~(qh_prev > qc_prev)
    terms = {"lm": jnp.mean(lm) / SEGMENTS, "q_halt": jnp.mean(lh) / SEGMENTS, "q_continue": jnp.mean(lc) / SEGMENTS,
             "segments": jnp.mean(runs)}
    return terms, runs


def _objective(terms):
    return sum(WEIGHTS[k] * v for k, v in terms.items())


def test_the_segments_losses_are_their_definition_values_and_gradients(graph):
    params, (x, y) = _params(graph), _data()
    want, runs = _plain(params, x, y)
    assert set(np.asarray(runs).astype(int).tolist()) == {1, 2, 3, SEGMENTS}
    got = jax.jit(lambda p: _terms(graph, p, x, y))(params)
    for k in WEIGHTS:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    g_got = jax.jit(jax.grad(lambda p: _objective(_terms(graph, p, x, y))))(params)
    g_want = jax.grad(lambda p: _objective(_plain(p, x, y)[0]))(params)
    for path in params:
        np.testing.assert_allclose(g_got[path], g_want[path], rtol=1e-4, atol=1e-6, err_msg=path)
        assert float(jnp.abs(g_got[path]).max()) > 0, path  # every weight learns: the Q-head and the readout too


def test_state_carried_between_segments_is_detached(graph):
    """Summed losses with detached state give each segment's gradient as if it were its own step: the gradient of
    the lm term is the sum over segments of each segment's gradient at the state the segments before reached."""
    params, (x, y) = _params(graph), _data()
    params[f"{Q}/bias"] = jnp.asarray([-50.0, 50.0])  # never halt: every sample runs every segment
    _, runs = _plain(params, x, y)
    assert set(np.asarray(runs).tolist()) == {float(SEGMENTS)}
    whole = jax.jit(jax.grad(lambda p: _terms(graph, p, x, y)["lm"]))(params)
    w, b = params[f"{NET}/weight"], params[f"{NET}/bias"]
    states = [jnp.zeros_like(x)]
    for _ in range(SEGMENTS * STEPS):
        states.append(jnp.tanh(jnp.einsum("bch,ho->bco", states[-1] + x, w) + b))

    def segment_loss(p, m):  # the m-th segment alone: its last step from the state before it, with the gradient
        z = jnp.tanh(jnp.einsum("bch,ho->bco", states[(m + 1) * STEPS - 1] + x, p[f"{NET}/weight"]) + p[f"{NET}/bias"])
        logits = jnp.einsum("bch,hv->bcv", z, p[f"{OUT}/weight"])
        ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[..., None], -1)[..., 0]
        return ce.mean() / SEGMENTS

    parts = [jax.grad(segment_loss)(params, m) for m in range(SEGMENTS)]
    for path in (f"{NET}/weight", f"{NET}/bias", f"{OUT}/weight"):
        np.testing.assert_allclose(whole[path], sum(g[path] for g in parts), rtol=1e-4, atol=1e-6, err_msg=path)


def test_the_q_learning_terms_are_a_numpy_computation(graph):
    """q_halt: BCE of sigmoid(q_halt) against "every cell right"; q_continue: BCE of sigmoid(q_continue) against the
    next segment's sigmoid(max(q_halt, q_continue)); each summed over the segments a sample runs (in float64)."""
    params, (x, y) = _params(graph), _data()
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    xs, ys = np.asarray(x, np.float64), np.asarray(y)
    bce = lambda z, t: np.log1p(np.exp(-np.abs(z))) + np.maximum(z, 0) - z * t  # noqa: E731
    sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    lh, lc, runs = np.zeros(len(xs)), np.zeros(len(xs)), np.zeros(len(xs))
    for i in range(len(xs)):
        z, prev = np.zeros_like(xs[i]), None
        for m in range(SEGMENTS):
            for _ in range(STEPS):
                z = np.tanh((z + xs[i]) @ p[f"{NET}/weight"] + p[f"{NET}/bias"])
            qh, qc = z.mean(axis=0) @ p[f"{Q}/weight"] + p[f"{Q}/bias"]
            right = float(np.all(np.argmax(z @ p[f"{OUT}/weight"], -1) == ys[i]))
            lh[i] += bce(qh, right)
            if prev is not None:
                lc[i] += bce(prev, sigmoid(max(qh, qc)))
            prev, runs[i] = qc, m + 1
            if qh > qc:
                break
    got = jax.jit(lambda p: _terms(graph, p, x, y))(params)
    assert set(runs.tolist()) == {1, 2, 3, SEGMENTS}
    np.testing.assert_allclose(got["q_halt"], lh.mean() / SEGMENTS, rtol=1e-5)
    np.testing.assert_allclose(got["q_continue"], lc.mean() / SEGMENTS, rtol=1e-5)
    np.testing.assert_allclose(got["segments"], runs.mean(), rtol=1e-6)


def test_the_tiny_model_round_trips_through_its_ir_text(graph):
    text = print_graph(graph)
    assert "exact_match(" in text and "token_cross_entropy(" in text and "softplus(" in text and "maximum(" in text
    assert print_graph(verify(parse_graph(text))) == text


HRM = dict(vocab=10, rows=3, cols=3, d_model=16, heads=2, head_dim=8, d_ff=32, l_layers=1, h_layers=1, l_steps=2,
           cycles=2, segments=SEGMENTS)


def _hrm(act: bool = True):
    graph = build_graph(ROOT / "models" / "hrm.tsl", {**HRM, "act": act})
    rng = np.random.default_rng(0)
    params = {p.path: jnp.asarray(rng.standard_normal([d.size for d in p.type.dims]) * 0.3, jnp.float32)
              for p in graph.params.values()}
    return graph, params


@pytest.fixture(scope="module")
def hrm():
    return _hrm()


def _segments_run(graph, params, monkeypatch, mode: str) -> int:
    """How many segments `mode` runs on a batch of puzzles: the Q-head's two `take`s run once a segment each."""
    ran = []
    plain_take = table.get_lowering("take")

    def counted(ctx, op, attrs, ins, local):
        jax.debug.callback(lambda: ran.append(1))
        return plain_take.fn(ctx, op, attrs, ins, local)

    monkeypatch.setitem(table.LOWERINGS, "take", table.Lowering("take", counted))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 10, (3, 9)), jnp.int32)
    ctx = LowerCtx(mode=mode, param_types={path: p.type for path, p in graph.params.items()})  # the Q-head's
    if mode == "forward":
        jax.jit(lambda p: eval_region(graph.body, [tokens], p, ctx)[0])(params)
    else:
        (loss,) = graph.losses
        jax.jit(lambda p: eval_region(loss.region, [tokens, tokens], p, ctx)[0])(params)
    jax.effects_barrier()
    assert len(ran) % 2 == 0
    return len(ran) // 2


@pytest.mark.parametrize("bias, segments", [([5.0, -5.0], 1), ([-5.0, 5.0], SEGMENTS), ([0.0, 0.0], SEGMENTS)],
                         ids=["halt", "continue", "initial"])
def test_hrm_inference_stops_when_every_puzzle_halts(hrm, monkeypatch, bias, segments):
    """q_halt above q_continue after the first segment: inference runs one segment of the cap, training's masked
    scan all of them; q_halt below, or equal (the Q-head's initial zeros): both run every segment."""
    graph, params = hrm
    params = {**params, "act/q_values/q_weight": params["act/q_values/q_weight"] * 0.0,
              "act/q_values/q_bias": jnp.asarray(bias, jnp.float32)}
    assert _segments_run(graph, params, monkeypatch, "forward") == segments
    assert _segments_run(graph, params, monkeypatch, "train") == SEGMENTS


def test_without_act_every_segment_runs(monkeypatch):
    """act = false: q_halt above q_continue halts nothing, inference runs every segment."""
    graph, params = _hrm(act=False)
    params = {**params, "act/q_values/q_weight": params["act/q_values/q_weight"] * 0.0,
              "act/q_values/q_bias": jnp.asarray([5.0, -5.0], jnp.float32)}
    assert _segments_run(graph, params, monkeypatch, "forward") == SEGMENTS


def test_an_explicit_param_read_without_the_graphs_param_types_says_so(hrm):
    graph, params = hrm
    tokens = jnp.zeros((2, 9), jnp.int32)
    with pytest.raises(ValueError, match=r"op `dot` reads a `param\(...\)` operand: .*LowerCtx.param_types"):
        eval_region(graph.body, [tokens], params, LowerCtx(mode="forward"))
