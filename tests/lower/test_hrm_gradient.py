"""HRM's one-step gradient as models/hrm.tsl writes it (every step reads the states it carries in through
stop_gradient, inside weight-shared repeats), held to the paper's definition: all steps but the last low-level
and the last high-level one run without gradient, those two with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.ir.elaborate import build_graph
from tessera.lower.context import LowerCtx
from tessera.lower.interpret import eval_region

# hrm.tsl's recurrence with one tanh layer for each module
MODEL = """
model tiny_hrm(width: int = 4, l_steps: int = 3, cycles: int = 2) {
  block cell(z: [points, hidden]) {
    y = linear(z, [hidden_out = width], over = [hidden], bias = true)
    return tanh(rename(y, hidden_out, hidden))
  }
  block low_step(zl: [points, hidden], zh: [points, hidden], x: [points, hidden]) {
    return cell(stop_gradient(zl) + zh + x) as net, zh, x
  }
  block cycle(zh: [points, hidden], zl: [points, hidden], x: [points, hidden]) {
    zh = stop_gradient(zh)
    zl, zh, x = repeat(l_steps, low_step, zl, zh, x, shared = true) as low
    return cell(zh + zl) as high, zl, x
  }
  forward(x: f32[points, hidden = width]) {
    zh, zl, x = repeat(cycles, cycle, x * 0.0, x * 0.0, x, shared = true) as cycles
    return zh
  }
}
"""
L_STEPS, CYCLES = 3, 2


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("hrm") / "tiny_hrm.tsl"
    path.write_text(MODEL)
    return build_graph(path, {})


def _cell(p, name, z):
    return jnp.tanh(z @ p[f"cycles/{name}/linear/weight"] + p[f"cycles/{name}/linear/bias"])


def _paper(p, x, one_step: bool = True):
    """The paper's loop: N T - 1 steps under no_grad (stop_gradient here), then one low and one high step."""
    zh = zl = jnp.zeros_like(x)
    nograd = jax.lax.stop_gradient if one_step else (lambda v: v)
    for i in range(CYCLES * L_STEPS - 1):
        zl = nograd(_cell(p, "low/net", zl + zh + x))
        if (i + 1) % L_STEPS == 0:
            zh = nograd(_cell(p, "high", zh + zl))
    zl = _cell(p, "low/net", zl + zh + x)
    return _cell(p, "high", zh + zl)


def test_one_step_gradient_matches_the_papers_definition(graph):
    rng = np.random.default_rng(0)
    params = {p.path: jnp.asarray(rng.standard_normal([d.size for d in p.type.dims]) * 0.5, jnp.float32)
              for p in graph.params.values()}
    assert sorted(params) == ["cycles/high/linear/bias", "cycles/high/linear/weight", "cycles/low/net/linear/bias",
                              "cycles/low/net/linear/weight"]  # one set each, shared by every step
    x = jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)
    probe = jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)

    def model(p, x):
        (out,), _ = eval_region(graph.body, [x], p, LowerCtx())
        return out

    np.testing.assert_allclose(model(params, x), _paper(params, x), rtol=1e-5, atol=1e-6)
    got = jax.grad(lambda p, x: jnp.sum(model(p, x) * probe), argnums=(0, 1))(params, x)
    want = jax.grad(lambda p, x: jnp.sum(_paper(p, x) * probe), argnums=(0, 1))(params, x)
    full = jax.grad(lambda p, x: jnp.sum(_paper(p, x, one_step=False) * probe), argnums=(0, 1))(params, x)
    for path in params:
        np.testing.assert_allclose(got[0][path], want[0][path], rtol=1e-4, atol=1e-6, err_msg=path)
        assert float(jnp.abs(got[0][path] - full[0][path]).max()) > 1e-4  # not backpropagation through time
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-6)
