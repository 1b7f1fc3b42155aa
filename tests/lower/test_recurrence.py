"""Weight-shared recurrence (`repeat(n, block, x, shared = true)`): one set of parameters for every iteration,
equal to a plain Python loop in values and gradients; nested repeats stack their params on distinct axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.diagnostics import TesseraError
from tessera.ir import parse_graph
from tessera.ir.elaborate import build_graph
from tessera.ir.printer import print_graph
from tessera.lower.context import LowerCtx
from tessera.lower.interpret import eval_region

MODEL = """
model rec(width: int = 4, n: int = 3, m: int = 2, shared: bool = true) {
  block step(h: [points, hidden]) {
    y = linear(h, [hidden_out = width], over = [hidden], bias = true)
    return tanh(rename(y, hidden_out, hidden))
  }
  block outer(h: [points, hidden]) {
    return repeat(m, step, h) as inner
  }
  forward(x: f32[points, hidden = width]) {
    h = repeat(n, step, x, shared = shared) as cell
    return repeat(2, outer, h) as deep
  }
}
"""


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "rec.tsl"
    path.write_text(MODEL)
    return build_graph(path, {})


def _params(graph, seed=0):
    rng = np.random.default_rng(seed)
    return {p.path: jnp.asarray(rng.standard_normal([d.size for d in p.type.dims]) * 0.5, jnp.float32)
            for p in graph.params.values()}


def _plain(params, x):
    """The same network as plain Python loops: the shared cell 3 times with one weight, then 2 x 2 stacked layers."""
    w, b = params["cell/linear/weight"], params["cell/linear/bias"]
    for _ in range(3):
        x = jnp.tanh(x @ w + b)
    for i in range(2):
        for j in range(2):
            x = jnp.tanh(x @ params["deep/inner/linear/weight"][i, j] + params["deep/inner/linear/bias"][i, j])
    return x


def test_shared_params_are_held_once_and_nested_ones_stack_on_distinct_axes(graph):
    types = {p.path: p.type for p in graph.params.values()}
    assert types["cell/linear/weight"].names == ("hidden", "hidden_out")        # one set, not [3, ...]
    assert types["deep/inner/linear/weight"].names == ("layers", "layers1", "hidden", "hidden_out")
    assert [d.size for d in types["deep/inner/linear/weight"].dims[:2]] == [2, 2]
    text = print_graph(graph)
    assert "axis = none" in text and print_graph(parse_graph(text)) == text  # the IR text round-trips


def test_the_recurrence_equals_python_loops_in_values_and_gradients(graph):
    params = _params(graph)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 4)), jnp.float32)

    def run(p, x):
        (out,), _ = eval_region(graph.body, [x], p, LowerCtx())
        return out

    np.testing.assert_allclose(run(params, x), _plain(params, x), rtol=1e-5, atol=1e-6)
    probe = jnp.asarray(np.random.default_rng(2).standard_normal((5, 4)), jnp.float32)
    got = jax.grad(lambda p: jnp.sum(run(p, x) * probe))(params)
    want = jax.grad(lambda p: jnp.sum(_plain(p, x) * probe))(params)
    for path in params:
        np.testing.assert_allclose(got[path], want[path], rtol=1e-4, atol=1e-6, err_msg=path)


def test_unrolled_iterations_read_the_shared_weights_whole(tmp_path):
    """Generation unrolls repeats: a shared repeat's iterations all read its one weight, a stacked one's
    iteration i reads layer i of its split params."""
    path = tmp_path / "flat.tsl"
    path.write_text(MODEL.replace("return repeat(2, outer, h) as deep", "return repeat(2, step, h) as deep"))
    graph = build_graph(path, {})
    params = _params(graph)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 4)), jnp.float32)
    (scanned,), _ = eval_region(graph.body, [x], params, LowerCtx())
    split = {k: (list(v) if k.startswith("deep") else v) for k, v in params.items()}
    (unrolled,), _ = eval_region(graph.body, [x], split, LowerCtx(unroll=True))
    np.testing.assert_allclose(unrolled, scanned, rtol=1e-6, atol=1e-6)
    w, b = params["cell/linear/weight"], params["cell/linear/bias"]
    want = x
    for _ in range(3):
        want = jnp.tanh(want @ w + b)
    for i in range(2):
        want = jnp.tanh(want @ params["deep/linear/weight"][i] + params["deep/linear/bias"][i])
    np.testing.assert_allclose(unrolled, want, rtol=1e-5, atol=1e-6)


def test_shared_takes_true_or_false(tmp_path):
    path = tmp_path / "bad.tsl"
    path.write_text(MODEL.replace("shared = shared", "shared = 3"))
    with pytest.raises(TesseraError, match="`shared` is true or false"):
        build_graph(path, {})
    path.write_text(MODEL.replace("shared = shared", "tied = true"))
    with pytest.raises(TesseraError, match=r"`repeat` has no argument `tied` \(arguments: shared, grad\)"):
        build_graph(path, {})



STOP = """
model stop(width: int = 4, n: int = 3) {
  block step(h: [points, hidden]) {
    y = linear(h, [hidden_out = width], over = [hidden], bias = true)
    return tanh(rename(y, hidden_out, hidden))
  }
  forward(x: f32[points, hidden = width]) {
    h = stop_gradient(repeat(n, step, x, shared = true) as cell)
    return square(x) + h
  }
}
"""


def test_stop_gradient_passes_values_and_no_gradient(tmp_path):
    """The first steps of a one-step gradient: a recurrence under stop_gradient gives its value forward and
    neither its input nor its weights get a gradient from it (nor keeps residuals for one)."""
    path = tmp_path / "stop.tsl"
    path.write_text(STOP)
    graph = build_graph(path, {})
    params = _params(graph)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 4)), jnp.float32)

    def run(p, x):
        (out,), _ = eval_region(graph.body, [x], p, LowerCtx())
        return out

    w, b = params["cell/linear/weight"], params["cell/linear/bias"]
    h = x
    for _ in range(3):
        h = jnp.tanh(h @ w + b)
    np.testing.assert_allclose(run(params, x), x * x + h, rtol=1e-5, atol=1e-6)
    gp, gx = jax.grad(lambda p, x: jnp.sum(run(p, x)), argnums=(0, 1))(params, x)
    np.testing.assert_allclose(gx, 2 * x, rtol=1e-6)                 # square's gradient only
    assert all(float(jnp.abs(g).max()) == 0.0 for g in gp.values())  # the weights get none
    text = print_graph(graph)
    assert "stop_gradient" in text and print_graph(parse_graph(text)) == text
