"""Norms, activations, linear and losses: against transformers' captured values and float64 numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from tessera.lower.reference import activations, linear, losses, norms

from .conftest import float64

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("layer", [0, 1])
def test_rms_norm_matches_transformers(gpt_oss_pieces, gpt_oss_params, layer):
    x = gpt_oss_pieces[f"layer{layer}.attn_norm.in"]
    got = norms.rms_norm(jnp.asarray(x), scale=gpt_oss_params["layers/attn_norm/scale"][layer], eps=1e-5)
    np.testing.assert_allclose(got, gpt_oss_pieces[f"layer{layer}.attn_norm.out"], atol=1e-6, rtol=1e-6)


def test_rms_norm_keeps_dtype_and_uses_fp32_statistics():
    x = jnp.asarray(RNG.standard_normal((3, 64)) * 100, jnp.bfloat16)
    y = norms.rms_norm(x, scale=jnp.ones(64), eps=1e-5)
    assert y.dtype == jnp.bfloat16
    ref = np.asarray(x, np.float64) / np.sqrt((np.asarray(x, np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=1e-2)


def test_rms_norm_llama_order_scales_in_the_input_dtype():
    x = jnp.asarray(RNG.standard_normal((4, 32)), jnp.bfloat16)
    s = jnp.asarray(1 + RNG.standard_normal(32) / 3, jnp.bfloat16)
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5)
    llama = norms.rms_norm(x, scale=s, eps=1e-5, scale_in_input_dtype=True)
    gpt_oss = norms.rms_norm(x, scale=s, eps=1e-5)
    np.testing.assert_array_equal(llama, s * normed.astype(jnp.bfloat16))
    np.testing.assert_array_equal(gpt_oss, (s.astype(jnp.float32) * normed).astype(jnp.bfloat16))
    assert not np.array_equal(np.asarray(llama, np.float32), np.asarray(gpt_oss, np.float32))


def test_layer_norm_matches_float64():
    x, s, b = RNG.standard_normal((4, 16)), RNG.standard_normal(16), RNG.standard_normal(16)
    got = norms.layer_norm(jnp.asarray(x, jnp.float32), scale=jnp.asarray(s), bias=jnp.asarray(b), eps=1e-5)
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * s + b
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_clamped_swiglu_matches_transformers(gpt_oss_pieces):
    gate_up = gpt_oss_pieces["swiglu.gate_up"]
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]  # interleaved, as GPT-OSS fuses them
    assert (gate > 7).any() and (up > 7).any() and (up < -7).any(), "the probe must exercise every clamp"
    got = activations.clamped_swiglu(jnp.asarray(gate), jnp.asarray(up), alpha=1.702, limit=7.0)
    np.testing.assert_allclose(got, gpt_oss_pieces["swiglu.out"], atol=1e-5, rtol=1e-6)
    # the fused layout is interleaved: the half split would give something else
    half = activations.clamped_swiglu(jnp.asarray(gate_up[:, :32]), jnp.asarray(gate_up[:, 32:]), alpha=1.702,
                                      limit=7.0)
    assert np.abs(np.asarray(half) - gpt_oss_pieces["swiglu.out"]).max() > 1.0


def test_clamped_swiglu_details():
    g = jnp.array([-20.0, -1.0, 0.5, 9.0])
    # the "+1" is on the linear branch: up = 0 still passes gate * sigmoid(alpha * gate)
    np.testing.assert_allclose(activations.clamped_swiglu(g, jnp.zeros(4), alpha=1.702, limit=7.0),
                               [-20 * jax.nn.sigmoid(-34.04), -jax.nn.sigmoid(-1.702), 0.5 * jax.nn.sigmoid(0.851),
                                7 * jax.nn.sigmoid(7 * 1.702)], rtol=1e-5)
    # the gate is clamped only from above (-20 stays -20); up is clamped on both sides
    assert activations.clamped_swiglu(jnp.array([1.0]), jnp.array([-50.0]), alpha=1.702, limit=7.0)[0] == \
        pytest.approx(-6 * float(jax.nn.sigmoid(1.702)), rel=1e-6)


def test_swiglu_and_gelu_values():
    g, u = jnp.array([-2.0, 0.0, 3.0]), jnp.array([1.5, 2.0, -1.0])
    np.testing.assert_allclose(activations.swiglu(g, u), [-2 / (1 + np.exp(2)) * 1.5, 0.0, -3 / (1 + np.exp(-3))],
                               rtol=1e-6)
    # torch.nn.functional.gelu (erf form) at -1, 1 and its tanh approximation at 1
    np.testing.assert_allclose(activations.gelu(jnp.array([-1.0, 1.0])), [-0.15865525393145707, 0.8413447460685429],
                               rtol=1e-6)
    assert float(activations.gelu(jnp.array(1.0), approximate=True)) == pytest.approx(0.8411919906082768, rel=1e-6)


def test_linear_and_project_out_layouts():
    x, w, b = RNG.standard_normal((2, 3, 8)), RNG.standard_normal((8, 4, 5)), RNG.standard_normal((4, 5))
    got = linear.linear(jnp.asarray(x, jnp.float32), weight=jnp.asarray(w, jnp.float32), bias=jnp.asarray(b))
    np.testing.assert_allclose(got, np.einsum("bsd,dhk->bshk", x, w) + b, atol=1e-4)
    o = RNG.standard_normal((4, 5, 8))
    got = linear.project_out(jnp.asarray(got), weight=jnp.asarray(o, jnp.float32))
    np.testing.assert_allclose(got, np.einsum("bshk,hkd->bsd", np.einsum("bsd,dhk->bshk", x, w) + b, o), atol=1e-3)


def test_cross_entropy_matches_float64_with_mask():
    logits, labels = RNG.standard_normal((2, 5, 11)) * 4, RNG.integers(0, 11, (2, 5))
    mask = RNG.random((2, 5)) > 0.3
    lse = np.log(np.exp(logits).sum(-1))
    per = lse - np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    got = losses.cross_entropy(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32), jnp.asarray(labels))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(losses.cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(labels)),
                               per.mean(), rtol=1e-5)
    np.testing.assert_allclose(losses.cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(labels),
                                                    mask=jnp.asarray(mask)), per[mask].mean(), rtol=1e-5)
    assert float(losses.cross_entropy(jnp.asarray(logits), jnp.asarray(labels), mask=jnp.zeros((2, 5)))) == 0.0


def test_cross_entropy_gradient_is_the_gathered_labels_bit_for_bit():
    """The label's logit is selected by comparison (no gather, whose gradient was a scatter that kept the cotangent
    in fp32 a pass longer): the loss and its bf16 gradient are the bits of the gathered form's."""
    logits = jnp.asarray(RNG.standard_normal((2, 16, 300)) * 4, jnp.bfloat16)
    labels, w = jnp.asarray(RNG.integers(0, 300, (2, 16))), jnp.asarray(RNG.random((2, 16)), jnp.float32)

    def gathered(x):
        lf = x.astype(jnp.float32)
        return jax.nn.logsumexp(lf, axis=-1) - jnp.take_along_axis(lf, labels[..., None], axis=-1)[..., 0]

    want, want_grad = jax.value_and_grad(lambda x: jnp.sum(gathered(x) * w))(logits)
    got, grad = jax.value_and_grad(lambda x: jnp.sum(losses.token_cross_entropy(x, labels) * w))(logits)
    assert got.tobytes() == want.tobytes() and grad.dtype == jnp.bfloat16
    assert grad.tobytes() == want_grad.tobytes() and bool(jnp.any(grad != 0))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(losses.token_cross_entropy(x, labels))))(logits))
    assert "scatter" not in jaxpr and "gather" not in jaxpr


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cross_entropy_gradient_from_kept_statistics_is_autodiffs_under_jit(dtype):
    """The loss's gradient from its kept maximum and sum (a custom VJP: no [..., V] fp32 residual, no second pass
    of reductions) is, compiled, the bits of autodiff's of the same operations and of the rematerialised loss that
    deterministic mode's head took before; a row of -inf logits past the label (a masked vocabulary) included."""
    logits = RNG.standard_normal((3, 8, 257)) * 4
    logits[0, :, 200:] = -np.inf
    logits = jnp.asarray(logits, dtype)
    labels = jnp.asarray(RNG.integers(0, 200, (3, 8)))
    w = jnp.asarray(RNG.random((3, 8)), jnp.float32)
    plain = lambda x: jnp.sum(losses._token_cross_entropy(x, labels) * w)  # noqa: E731 (autodiff's gradient)
    kept = lambda x: jnp.sum(losses.token_cross_entropy(x, labels) * w)  # noqa: E731
    remat = lambda x: jnp.sum(jax.checkpoint(losses._token_cross_entropy)(x, labels) * w)  # noqa: E731
    want, want_grad = jax.jit(jax.value_and_grad(plain))(logits)
    for fn in (kept, remat):
        got, grad = jax.jit(jax.value_and_grad(fn))(logits)
        assert got.tobytes() == want.tobytes() and grad.dtype == dtype
        assert grad.tobytes() == want_grad.tobytes()
    assert bool(jnp.all(jnp.isfinite(want_grad))) and bool(jnp.all(want_grad[0, :, 200:] == 0))
    jaxpr = str(jax.make_jaxpr(jax.grad(kept))(logits))
    assert jaxpr.count("reduce_max") == 1 and jaxpr.count("exp") == 2  # the forward's max; exp once each way


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_swiglu_keeps_gate_and_up_and_its_gradient_is_autodiffs(dtype):
    """SwiGLU's VJP holds its two inputs only (autodiff of the same expression held five fp32 values: the inputs
    widened, the sigmoid, its derivative and silu, what a layer without a remat policy keeps to its backward), and its
    gradients, compiled, are the bits of autodiff's."""
    def plain(gate, up):
        g = gate.astype(jnp.float32)
        return (g * jax.nn.sigmoid(g) * up.astype(g.dtype)).astype(gate.dtype)

    gate, up, dh = (jnp.asarray(RNG.standard_normal((16, 96)) * 3, dtype) for _ in range(3))
    held = [x for x in jax.tree_util.tree_leaves(jax.vjp(activations.swiglu, gate, up)[1]) if x.size > 1]
    assert [(x.shape, x.dtype) for x in held] == [(gate.shape, dtype)] * 2
    autodiff = [x for x in jax.tree_util.tree_leaves(jax.vjp(plain, gate, up)[1]) if x.size > 1]
    assert sum(x.nbytes for x in autodiff) > 2 * sum(x.nbytes for x in held)
    want = jax.jit(lambda *a: jax.vjp(plain, *a[:2])[1](a[2]))(gate, up, dh)
    got = jax.jit(lambda *a: jax.vjp(activations.swiglu, *a[:2])[1](a[2]))(gate, up, dh)
    assert all(g.dtype == dtype and g.tobytes() == w.tobytes() for g, w in zip(got, want))


def _away_from(x, points, margin=0.05):
    # nudge values off the kinks (clamp limits) so finite differences are smooth
    for p in points:
        x = np.where(np.abs(x - p) < margin, p + 2 * margin, x)
    return x


def test_gradients_against_finite_differences():
    with float64():
        r = np.random.default_rng(3)
        x, s, b = (jnp.asarray(r.standard_normal(sh)) for sh in ((3, 8), (8,), (8,)))
        g = jnp.asarray(_away_from(r.standard_normal((3, 8)) * 6, [7.0]))
        u = jnp.asarray(_away_from(r.standard_normal((3, 8)) * 6, [-7.0, 7.0]))
        labels = jnp.asarray(r.integers(0, 8, (3,)))
        w = jnp.asarray(r.standard_normal((8, 2, 4)))
        cases = [
            (lambda x, s: norms.rms_norm(x, scale=s, eps=1e-5), (x, s)),
            (lambda x, s, b: norms.layer_norm(x, scale=s, bias=b, eps=1e-5), (x, s, b)),
            (lambda g, u: activations.clamped_swiglu(g, u, alpha=1.702, limit=7.0), (g, u)),
            (activations.swiglu, (x, s[None])),
            (activations.gelu, (x,)),
            (lambda x, w: linear.linear(x, weight=w, bias=None), (x, w)),
            (lambda x: losses.cross_entropy(x, labels, mask=jnp.array([1.0, 0.0, 1.0])), (x,)),
        ]
        for fn, args in cases:
            check_grads(jax.jit(fn), args, order=1, modes=("rev",), atol=1e-6, rtol=1e-6)
