"""The spectral mixture of experts (`spectral_moe`, tessera/ir/ops_spectral.py): routing and mode mixing against a
plain numpy reference (per band and per sample, operand dims in any order), gradients by finite differences, FLOPs
and active parameters, IR round-trip of the op and of models/spectral_moe.tsl through every pass, and refusals."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.diagnostics import TesseraError
from tessera.ir import build_graph, parse_graph, print_graph, verify
from tessera.ir.cost import param_summary
from tessera.ir.flops import op_flops
from tessera.ir.passes import PIPELINE, stages
from tessera.lower.context import LowerCtx
from tessera.lower.interpret import eval_region

MODELS = Path(__file__).resolve().parents[2] / "models"
RNG = np.random.default_rng(0)
E, K, C, O = 3, 2, 3, 3  # experts, top_k, channels (width), channels out


@pytest.fixture(autouse=True, scope="module")
def _x64():
    """f64 (finite differences need it); the setting is restored for the next module."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def _layer(modes: int, bands: int, dims: str = "batch=2, space=16, width=3", bias: str = "true") -> str:
    return f"""graph g {{
  input %x : f64[{dims}]
  param @m/router : f64[width=3, experts={E}] = normal(0.577)
  param @m/router_bias : f64[experts={E}] = zeros
  param @m/experts/w_re : f64[experts={E}, modes={modes}, width=3, width_out=3] = normal(0.408)
  param @m/experts/w_im : f64[experts={E}, modes={modes}, width=3, width_out=3] = normal(0.408)
  %0 = spectral_moe(%x, @m/router, @m/router_bias, @m/experts/w_re, @m/experts/w_im) {{over = space, modes = {modes}, channels = width, experts = {E}, top_k = {K}, bands = {bands}, bias = {bias}}} : f64[{dims}]
  return %0
}}
"""


def _params(modes: int) -> dict:
    shape = (E, modes, C, O)
    return {"m/router": RNG.standard_normal((C, E)), "m/router_bias": RNG.standard_normal(E),
            "m/experts/w_re": RNG.standard_normal(shape), "m/experts/w_im": RNG.standard_normal(shape)}


def _numpy(x, p, modes: int, bands: int):
    """The op's semantics, one sample and one band at a time: x [T, n, c] -> [T, n, o]."""
    f = np.fft.rfft(x, axis=1)[:, :modes]
    w = p["m/experts/w_re"] + 1j * p["m/experts/w_im"]
    out, width = np.zeros((x.shape[0], modes, O), complex), modes // bands
    for t in range(x.shape[0]):
        for b in range(bands):
            band = slice(b * width, (b + 1) * width)
            logits = np.log(np.mean(np.abs(f[t, band]) ** 2, axis=0)) @ p["m/router"] + p["m/router_bias"]
            chosen = np.argsort(-logits, kind="stable")[:K]               # top_k, ties to the lower id
            weights = np.exp(logits[chosen] - logits[chosen].max())
            for wj, e in zip(weights / weights.sum(), chosen):            # softmax among the chosen
                out[t, band] += wj * np.einsum("mc,mco->mo", f[t, band], w[e, band])
    return np.fft.irfft(out, n=x.shape[1], axis=1)


def _run(text: str, x, params: dict):
    graph = verify(parse_graph(text))
    fn = jax.jit(lambda x, p: eval_region(graph.body, [x], p, LowerCtx())[0][0])  # one compile, not op by op
    return graph, np.asarray(fn(jnp.asarray(x), {k: jnp.asarray(v) for k, v in params.items()}))


@pytest.mark.parametrize("modes, bands", [(6, 3), (5, 1)])
def test_routing_and_mixing_match_numpy_per_band_and_per_sample(modes, bands):
    x, p = RNG.standard_normal((2, 16, C)), _params(modes)
    graph, y = _run(_layer(modes, bands), x, p)
    np.testing.assert_allclose(y, _numpy(x, p, modes, bands), atol=1e-12)
    assert print_graph(parse_graph(print_graph(graph))) == print_graph(graph)  # the IR text round-trips


def test_samples_are_every_dim_but_the_transformed_one_and_the_channels_in_any_order():
    x, p = RNG.standard_normal((16, 2, C, 3)), _params(4)  # [space, batch, width, time]
    _, y = _run(_layer(4, 2, "space=16, batch=2, width=3, time=3"), x, p)
    flat = x.transpose(1, 3, 0, 2).reshape(6, 16, C)       # samples (batch, time) in order
    want = _numpy(flat, p, 4, 2).reshape(2, 3, 16, O).transpose(2, 0, 3, 1)
    np.testing.assert_allclose(y, want, atol=1e-12)


def test_gradients_match_finite_differences():
    """The expert weights, the router (through the softmax over the chosen k) and the input (through the mixing
    and the band powers the router reads)."""
    graph = verify(parse_graph(_layer(4, 2)))
    x, p = jnp.asarray(RNG.standard_normal((2, 16, C))), {k: jnp.asarray(v) for k, v in _params(4).items()}
    probe = jnp.asarray(RNG.standard_normal((2, 16, O)))

    @jax.jit
    def loss(p, x):
        (y,), _ = eval_region(graph.body, [x], p, LowerCtx())
        return jnp.sum(y * probe)

    gp, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x)
    eps = 1e-6
    for name, index in [("m/experts/w_re", (0, 1, 2, 0)), ("m/experts/w_im", (2, 3, 0, 1)), ("m/router", (1, 2)),
                        ("m/router_bias", (0,))]:
        bump = jnp.zeros(p[name].shape).at[index].set(eps)
        fd = (loss({**p, name: p[name] + bump}, x) - loss({**p, name: p[name] - bump}, x)) / (2 * eps)
        np.testing.assert_allclose(gp[name][index], fd, rtol=1e-5, atol=1e-9)
    assert np.abs(np.asarray(gp["m/router"])).max() > 0  # k = 2: the router learns from the weights' split
    bump = jnp.zeros(x.shape).at[1, 5, 2].set(eps)
    np.testing.assert_allclose(gx[1, 5, 2], (loss(p, x + bump) - loss(p, x - bump)) / (2 * eps), rtol=1e-5)


def test_flops_and_active_parameters():
    graph = verify(parse_graph(_layer(6, 3)))
    (op,) = graph.body.ops
    transforms = 2 * (2 * 3) * 0.5 * 5 * 16 * 4                  # rfft in and irfft out of 6 lines of 16 points
    router = 2 * (4 * 6 * 3 + 2 * 3 * 3 * E)                       # band powers, then logits per band
    assert op_flops(op, graph, {}) == transforms + router + K * 8 * 2 * 6 * 3 * 3
    summary = param_summary(graph)
    experts = 2 * E * 6 * 3 * 3
    assert summary["total"] == 3 * E + E + experts and summary["active"] == 3 * E + E + experts * K // E


@pytest.mark.parametrize("change, message", [
    (("top_k = 2", "top_k = 4"), "top_k (4) must be between 1 and experts (3)"),
    (("bands = 3", "bands = 4"), "bands = 4 must divide modes = 6 (bands of equal width): use one of 1, 2, 3, 6"),
    (("modes = 6, channels", "modes = 10, channels"), "16 points along `space` hold 1 to 9 modes"),
    (("channels = width", "channels = space"), "`over` and `channels` must be different dims"),
    (("f64[batch=2, space=16, width=3]\n  param", "bf16[batch=2, space=16, width=3]\n  param"),
     "XLA has no FFT in bf16"),
])
def test_misuse_is_refused_with_the_reason(change, message):
    with pytest.raises(TesseraError, match=message.replace("(", r"\(").replace(")", r"\)")):
        verify(parse_graph(_layer(6, 3).replace(*change)))


def test_without_bias_the_router_has_none():
    graph = verify(parse_graph(_layer(6, 3, bias="false").replace("  param @m/router_bias : f64[experts=3] = zeros\n",
                                                                   "").replace("@m/router_bias, ", "")))
    p = {k: v for k, v in _params(6).items() if k != "m/router_bias"}
    x = RNG.standard_normal((2, 16, C))
    _, y = _run(print_graph(graph), x, p)
    np.testing.assert_allclose(y, _numpy(x, {**p, "m/router_bias": np.zeros(E)}, 6, 3), atol=1e-12)


ARGS = dict(points=64, width=8, modes=8, layers=2, proj=16, experts=4, top_k=2, bands=2)


def test_the_model_round_trips_through_every_pass():
    graph = build_graph(MODELS / "spectral_moe.tsl", ARGS)
    seen = []
    for name, g in stages(graph):
        text = print_graph(g)
        again = verify(parse_graph(text))
        assert print_graph(again) == text, name
        seen.append(name)
    assert seen == PIPELINE
    assert {p: list(v.axes) for p, v in graph.params.items() if "spectral_moe" in p} == {
        "net/layers/spectral_moe/router": ["layers", "width", "experts"],
        "net/layers/spectral_moe/router_bias": ["layers", "experts"],
        "net/layers/spectral_moe/experts/w_re": ["layers", "experts", "modes", "width", "width_out"],
        "net/layers/spectral_moe/experts/w_im": ["layers", "experts", "modes", "width", "width_out"]}


def test_a_bad_argument_in_the_model_is_a_positioned_error():
    with pytest.raises(TesseraError) as exc:
        build_graph(MODELS / "spectral_moe.tsl", {**ARGS, "bands": 3})
    d = exc.value.diagnostics[0]
    assert "bands = 3 must divide modes = 8" in d.message
    assert d.span is not None and d.span.file.endswith("spectral_moe.tsl") and d.span.line == 11


def test_the_routing_is_moes_and_its_gradient_too():
    """route_smooth gives route's weights and experts, and route's gradients by the softmax's own rule."""
    from tessera.lower.reference import moe as moe_ref

    x, router, bias = (jnp.asarray(RNG.standard_normal(s)) for s in ((5, 3), (3, 4), (4,)))
    probe = jnp.asarray(RNG.standard_normal((5, 2)))
    plain = moe_ref.route(x, router=router, router_bias=bias, top_k=2)
    smooth = moe_ref.route_smooth(x, router, bias, 2)
    np.testing.assert_array_equal(smooth[1], plain[1])
    np.testing.assert_array_equal(smooth[0], plain[0])
    grads = [jax.grad(lambda *a: jnp.sum(fn(*a)[0] * probe), argnums=(0, 1, 2))(x, router, bias)
             for fn in (lambda x, r, b: moe_ref.route(x, router=r, router_bias=b, top_k=2),
                        lambda x, r, b: moe_ref.route_smooth(x, r, b, 2))]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
