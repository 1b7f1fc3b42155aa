"""Derivative ops (jvp, vjp, grad, custom_vjp) and loss entries: against finite differences in float64, through
`repeat`; IR round-trips; positioned errors for misuse; a declared adjoint that is provably the one used."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.diagnostics import TesseraError
from tessera.ir.elaborate import build_graph
from tessera.ir.parser import parse_graph
from tessera.ir.printer import print_graph
from tessera.ir.verify import verify
from tessera.lower.context import LowerCtx
from tessera.lower.interpret import eval_region

MODEL = """
model m(width: int = 6) {
  block layer(h: [points, hidden]) {
    return tanh(rename(linear(h, [hidden_out = width], over = [hidden], bias = true), hidden_out, hidden) * 20.0)
  }
  block net(x: [points, coord]) {
    h = tanh(linear(x, [hidden = width], over = [coord], bias = true) as input * 20.0)
    h = repeat(2, layer, h) as layers
    return linear(h, [field = 2], over = [hidden]) as output * 20.0
  }
  block net_x(x: [points, coord]) { return jvp(net, x, basis(x, coord, 0)) }
  block energy(x: [points, coord]) { return sum(sin(take(net(x), field, 0)), over = [points]) }
  forward(x: f64[points, coord = 2]) { return net(x) }
  loss terms(x: f64[points, coord = 2], w: f64[points, field = 2]) -> first, second, gradient, pullback, stacked {
    a = mean(cos(take(x, coord, 0)), over = [points])
    b = mean(take(x, coord, 1), over = [points])
    return mean(take(jvp(net, x, basis(x, coord, 1)), field, 0), over = [points]),
           mean(take(jvp(net_x, x, basis(x, coord, 0)), field, 1), over = [points]),
           mean(take(grad(energy, x), coord, 1), over = [points]),
           mean(take(vjp(net, x, w), coord, 0), over = [points]),
           sum(square(stack(a, b, dim = pair)), over = [pair])
  }
}
"""


def _model(tmp_path, text: str, name: str = "m.tsl"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return build_graph(_model(tmp_path_factory.mktemp("m"), MODEL), {})


def _params(graph, key=0):
    k = jax.random.key(key)
    return {p: 0.05 * jax.random.normal(jax.random.fold_in(k, i), tuple(d.size for d in v.type.dims), jnp.float64)
            for i, (p, v) in enumerate(graph.params.items())}


CTX = LowerCtx(kernels="reference", backend="cpu", deterministic=True)


def test_derivatives_match_finite_differences_in_float64_through_repeat(graph):
    with jax.enable_x64(True):
        params = _params(graph)
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.uniform(-1, 1, (7, 2)))
        w = jnp.asarray(rng.normal(size=(7, 2)))
        got, _ = jax.jit(lambda x, w: eval_region(graph.losses[0].region, [x, w], params, CTX)[0])(x, w), None
        f = lambda x: eval_region(graph.body, [x], params, CTX)[0][0]  # noqa: E731
        h = 1e-4
        e0, e1 = jnp.array([h, 0.0]), jnp.array([0.0, h])
        d_y = (f(x + e1) - f(x - e1)) / (2 * h)
        d_xx = (f(x + e0) - 2 * f(x) + f(x - e0)) / h ** 2
        # `energy` calls `net`: the same `@net/...` the forward reads, so d/dy of sum(sin(u)) is cos(u) du/dy
        g_y = jnp.cos(f(x)[:, 0]) * d_y[:, 0]
        d_x = (f(x + e0) - f(x - e0)) / (2 * h)
        pull_x = jnp.sum(w * d_x, axis=1)  # (w^T J)_x
        want = [jnp.mean(d_y[:, 0]), jnp.mean(d_xx[:, 1]), jnp.mean(g_y), jnp.mean(pull_x),
                jnp.mean(jnp.cos(x[:, 0])) ** 2 + jnp.mean(x[:, 1]) ** 2]
        assert all(g.dtype == jnp.float64 for g in got)
        for name, g, wv, tol in zip(graph.losses[0].terms, got, want, [1e-7, 1e-5, 1e-7, 1e-7, 1e-12]):
            assert abs(float(g) - float(wv)) <= tol * max(1.0, abs(float(wv))), name
        assert abs(float(got[1])) > 1e-3 and abs(float(got[0])) > 1e-3  # not trivially zero


def test_derivative_ops_and_loss_entries_round_trip(graph):
    text = print_graph(graph)
    for op in ("= jvp(", "= vjp(", "= grad(", "= take(", "= basis(", "= mean(", "= stack(", "= sin(", "= cos(",
               "= square(", "loss terms -> [first, second, gradient, pullback, stacked] ^("):
        assert op in text, op
    again = verify(parse_graph(text))
    assert print_graph(again) == text and again == graph


SHARED = """
model s(width: int = 5) {
  block layer(h: [points, hidden]) {
    return tanh(rename(linear(h, [hidden_out = width], over = [hidden], bias = true), hidden_out, hidden) * 20.0)
  }
  block net(x: [points, coord]) {
    h = tanh(linear(x, [hidden = width], over = [coord], bias = true) as input * 20.0)
    return linear(repeat(2, layer, h) as layers, [field = 2], over = [hidden]) as output * 20.0
  }
  block energy(x: [points, coord]) { return sum(sin(take(net(x), field, 0)), over = [points]) }
  block apart(x: [points, coord]) { return sum(sin(take(net(x) as twin, field, 0)), over = [points]) }
  forward(x: f64[points, coord = 2]) { return net(x) }
  loss l(x: f64[points, coord = 2]) -> direct, gradient, second, twin {
    return energy(x), mean(take(grad(energy, x), coord, 1), over = [points]),
           mean(take(jvp(energy_x, x, basis(x, coord, 0)), coord, 0), over = [points]),
           mean(take(grad(apart, x), coord, 0), over = [points])
  }
  block energy_x(x: [points, coord]) { return grad(energy, x) }
}
"""


def test_a_network_called_inside_a_derivative_region_is_the_forwards_network(tmp_path):
    """`grad(energy, x)` of an `energy` that calls `net` reads `net`'s params, not a copy `energy/net/...`: the
    param tree holds the network once, and the derivative region's result is the derivative of the forward's
    output (float64). `net(x) as twin` is a separate instance, under its caller's scope."""
    graph = build_graph(_model(tmp_path, SHARED, "s.tsl"), {})
    net = ["net/input/weight", "net/input/bias", "net/layers/linear/weight", "net/layers/linear/bias",
           "net/output/weight"]
    assert list(graph.params) == net + ["apart/twin/" + p.removeprefix("net/") for p in net]
    assert all(graph.params[p].type == graph.params["apart/twin/" + p.removeprefix("net/")].type for p in net)
    region_params = {o.path for op in graph.losses[0].region.walk() for o in op.operands if hasattr(o, "path")}
    assert region_params == set(graph.params)
    text = print_graph(graph)
    assert "energy/" not in text.replace('"energy', "")  # no param path under energy/
    again = verify(parse_graph(text))
    assert print_graph(again) == text and again == graph
    with jax.enable_x64(True):
        params = _params(graph)
        x = jnp.asarray(np.random.default_rng(2).uniform(-1, 1, (9, 2)))
        got = jax.jit(lambda x: eval_region(graph.losses[0].region, [x], params, CTX)[0])(x)
        forward = lambda x: eval_region(graph.body, [x], params, CTX)[0][0]  # noqa: E731
        energy = lambda x: jnp.sum(jnp.sin(forward(x)[:, 0]))  # noqa: E731
        twin = {p: params["apart/twin/" + p.removeprefix("net/")] for p in net}
        twin_energy = lambda x: jnp.sum(jnp.sin(eval_region(graph.body, [x], twin, CTX)[0][0][:, 0]))  # noqa: E731
        e0 = jnp.zeros_like(x).at[:, 0].set(1.0)
        d_xx = jax.jvp(lambda x: jax.grad(energy)(x)[:, 0], (x,), (e0,))[1]  # energy is a sum over the points
        want = jax.jit(lambda x: [energy(x), jnp.mean(jax.grad(energy)(x)[:, 1]), jnp.mean(d_xx),
                                  jnp.mean(jax.grad(twin_energy)(x)[:, 0]), jnp.mean(jax.grad(energy)(x)[:, 0])])(x)
        for name, g, w in zip(graph.losses[0].terms, got, want):
            assert g.dtype == jnp.float64
            np.testing.assert_allclose(float(g), float(w), rtol=1e-12, atol=1e-14, err_msg=name)
        assert abs(float(got[3]) - float(want[4])) > 1e-3  # the twin is another network


def test_a_block_called_by_name_twice_is_one_network_and_as_makes_another(tmp_path):
    text = """
model t() {
  block net(x: [points, coord]) { return linear(x, [field = 2], over = [coord]) }
  block outer(x: [points, coord]) { return net(x) + net(x) as other }
  forward(x: f32[points, coord = 2]) { return net(x) + outer(x) }
}
"""
    graph = build_graph(_model(tmp_path, text, "t.tsl"), {})
    assert list(graph.params) == ["net/linear/weight", "outer/other/linear/weight"]


ADJOINT = """
model a() {
  block clip(x: [points, coord]) { return x * 2.0 } adjoint(x, y, dy) { return dy * 0.0 + 7.0 * x / x }
  forward(x: f64[points, coord = 2]) { return clip(x) }
  loss l(x: f64[points, coord = 2]) { return sum(sum(clip(x), over = [coord]), over = [points]) }
}
"""


def test_a_declared_adjoint_is_the_one_differentiation_uses(tmp_path):
    graph = build_graph(_model(tmp_path, ADJOINT), {})
    text = print_graph(graph)
    assert "custom_vjp(" in text and "} adjoint ^(" in text
    assert print_graph(verify(parse_graph(text))) == text
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(1).uniform(1, 2, (3, 2)))
        loss = lambda x: eval_region(graph.losses[0].region, [x], {}, CTX)[0][0]  # noqa: E731
        np.testing.assert_allclose(float(loss(x)), 2 * float(jnp.sum(x)))  # the forward is the block's
        np.testing.assert_array_equal(np.asarray(jax.grad(loss)(x)), np.full((3, 2), 7.0))  # the marker, not 2


@pytest.mark.parametrize("body, message, line, col", [
    ("  forward(x: f32[points, coord = 2]) { return linear(net(x), [field = 2], over = [field]) }",
     "output dim `field` is already a dim of the input", 3, 47),
    ("  forward(t: i32[points, coord = 2]) { return jvp(net, t, t) }",
     "cannot differentiate with respect to the integer input", 3, 56),
    ("  forward(x: f32[points, coord = 2]) { return grad(net, x) }",
     "grad needs a region that returns a float scalar, got f32[points, field=2]", 3, 47),
    ("  forward(x: f32[points, coord = 2]) { return x }\n  loss l(x: f32[points, coord = 2]) { return net(x) }",
     "loss term `l` must be a scalar", 4, 46),
    ("  forward(x: f32[points, coord = 2]) { return x }\n  loss l(x: f32[points, coord = 2]) -> a, b { return mean(x, over = [points, coord]) }",
     "`loss l` names 2 term(s) (a, b) but returns 1 value(s)", 4, 54),
])
def test_misuse_is_a_positioned_error(tmp_path, body, message, line, col):
    text = ("model e() {\n  block net(x: [points, coord]) { return linear(x, [field = 2], over = [coord]) }\n"
            + body + "\n}\n")
    with pytest.raises(TesseraError) as exc:
        build_graph(_model(tmp_path, text, "e.tsl"), {})
    d = exc.value.diagnostics[0]
    assert message in d.message
    assert (d.span.line, d.span.col) == (line, col)
