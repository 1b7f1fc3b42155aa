"""MoE: top-k-then-softmax routing, interleaved gate/up, per-expert down bias, sorted vs dense formulations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.reference import moe

from .conftest import directional_grad_check, float64

NAMES = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")


def _layer(p, i):
    out = {n: p[f"layers/moe/experts/{n}"][i] for n in NAMES}
    out.update(router=p["layers/moe/router"][i], router_bias=p["layers/moe/router_bias"][i])
    return out


def _tokens(pieces, i):
    x = pieces[f"layer{i}.moe.in"]
    return jnp.asarray(x.reshape(-1, x.shape[-1])), pieces[f"layer{i}.moe.out"].reshape(-1, x.shape[-1])


@pytest.mark.parametrize("layer", [0, 1])
def test_routing_is_top_k_then_softmax(gpt_oss_pieces, gpt_oss_params, layer):
    x, _ = _tokens(gpt_oss_pieces, layer)
    w = _layer(gpt_oss_params, layer)
    weights, experts = moe.route(x, router=w["router"], router_bias=w["router_bias"], top_k=2)
    np.testing.assert_array_equal(experts, gpt_oss_pieces[f"layer{layer}.router.indices"])
    np.testing.assert_allclose(weights, gpt_oss_pieces[f"layer{layer}.router.scores"], atol=1e-6)
    np.testing.assert_allclose(x @ w["router"] + w["router_bias"], gpt_oss_pieces[f"layer{layer}.router.logits"],
                               atol=1e-5)
    # softmax over all experts, then top-k, would give weights that do not sum to one
    full = jax.nn.softmax(gpt_oss_pieces[f"layer{layer}.router.logits"], axis=-1)
    assert np.abs(np.sort(full, -1)[:, -2:].sum(-1) - 1).max() > 1e-2


def test_router_logits_sum_fixed_blocks_whatever_the_token_count():
    """A few tokens, K = 96 in blocks of 32: each block summed, then the blocks; a token's logits have the same
    bits alone or among others, and equal a float64 product to fp32 rounding; K not a multiple of the block,
    or more than ROUTER_ROWS_MAX tokens: one einsum."""
    kx, kw = jax.random.split(jax.random.PRNGKey(7))
    x = jax.random.normal(kx, (6, 96), jnp.bfloat16)
    w = jax.random.normal(kw, (96, 5), jnp.bfloat16)
    many = np.asarray(jax.jit(moe.router_logits)(x, w))
    for t in range(6):
        np.testing.assert_array_equal(np.asarray(jax.jit(moe.router_logits)(x[t:t + 1], w))[0], many[t])
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(many, exact, rtol=0, atol=1e-4 * np.abs(exact).max())
    blocks = (np.asarray(x, np.float32).reshape(6, 3, 32, 1) * np.asarray(w, np.float32).reshape(1, 3, 32, 5))
    np.testing.assert_allclose(many, blocks.sum(2).sum(1), rtol=1e-6, atol=1e-5)
    odd = jax.random.normal(kx, (2, 40), jnp.bfloat16)
    wo = jax.random.normal(kw, (40, 5), jnp.bfloat16)
    np.testing.assert_array_equal(moe.router_logits(odd, wo),
                                  jnp.einsum("td,de->te", odd, wo, preferred_element_type=jnp.float32))
    big = jax.random.normal(kx, (moe.ROUTER_ROWS_MAX + 1, 96), jnp.bfloat16)
    np.testing.assert_array_equal(moe.router_logits(big, w),
                                  jnp.einsum("td,de->te", big, w, preferred_element_type=jnp.float32))


@pytest.mark.parametrize("formulation", [moe.moe, moe.moe_pairs, moe.moe_dense])
@pytest.mark.parametrize("layer", [0, 1])
def test_moe_block_matches_transformers(gpt_oss_pieces, gpt_oss_params, formulation, layer):
    x, want = _tokens(gpt_oss_pieces, layer)
    got = formulation(x, top_k=2, **_layer(gpt_oss_params, layer))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def _mismatch(pieces, params, **change):
    x, want = _tokens(pieces, 0)
    w = dict(_layer(params, 0), **change)
    return np.abs(np.asarray(moe.moe_dense(x, top_k=2, **w)) - want).max()


def test_wrong_semantics_are_caught(gpt_oss_pieces, gpt_oss_params):
    w = _layer(gpt_oss_params, 0)
    # gate and up swapped (what a non-interleaved split would confuse)
    assert _mismatch(gpt_oss_pieces, gpt_oss_params, gate=w["up"], up=w["gate"], gate_bias=w["up_bias"],
                     up_bias=w["gate_bias"]) > 1e-2
    # no "+1" on the linear branch
    plain = lambda g, u: moe.GPT_OSS_ACT(g, u - 1.0)  # (up + 1) - 1: as if the +1 were missing
    assert _mismatch(gpt_oss_pieces, gpt_oss_params, act=plain) > 1e-2
    # one down bias shared by all experts instead of per expert
    assert _mismatch(gpt_oss_pieces, gpt_oss_params, down_bias=jnp.broadcast_to(w["down_bias"][:1],
                                                                               w["down_bias"].shape)) > 1e-2


def _random_moe(r, t=10, d=8, e=4, f=6, dtype=np.float64):
    w = dict(router=r.standard_normal((d, e)), router_bias=r.standard_normal(e), gate=r.standard_normal((e, d, f)),
             up=r.standard_normal((e, d, f)), down=r.standard_normal((e, f, d)), gate_bias=r.standard_normal((e, f)),
             up_bias=r.standard_normal((e, f)), down_bias=r.standard_normal((e, d)))
    return jnp.asarray(r.standard_normal((t, d)), dtype), {k: jnp.asarray(v, dtype) for k, v in w.items()}


def test_sorted_equals_dense_when_an_expert_gets_no_tokens():
    x, w = _random_moe(np.random.default_rng(0), dtype=np.float32)
    w["router_bias"] = jnp.array([50.0, 40.0, -50.0, -50.0])  # experts 2 and 3 receive nothing
    sorted_, dense = (jax.jit(lambda x, w, f=f: f(x, top_k=2, **w))(x, w) for f in (moe.moe, moe.moe_dense))
    np.testing.assert_allclose(sorted_, dense, atol=1e-5)


def test_sorted_moe_gradient():
    with float64():
        x, w = _random_moe(np.random.default_rng(1))
        f = lambda x, gate, up, down, down_bias: moe.moe(
            x, top_k=2, gate=gate, up=up, down=down, down_bias=down_bias,
            **{k: w[k] for k in ("router", "router_bias", "gate_bias", "up_bias")}, act=moe.GPT_OSS_ACT)
        directional_grad_check(f, (x, w["gate"], w["up"], w["down"], w["down_bias"]))
        gs = jax.jit(jax.grad(lambda x, w: moe.moe(x, top_k=2, **w).sum()))(x, w)
        gd = jax.jit(jax.grad(lambda x, w: moe.moe_dense(x, top_k=2, **w).sum()))(x, w)
        np.testing.assert_allclose(gs, gd, atol=1e-10)


def test_experts_in_canonical_chunks_compute_the_same_moe():
    """Deterministic tp's chunks of the experts' hidden dim (chunks=(k, ()): all of them on one device) give the
    unchunked block and its gradients, in float64 to rounding (the chunked sum adds the hidden dim in two parts)."""
    with float64():
        x, w = _random_moe(np.random.default_rng(2))
        plain, cut = (jax.jit(jax.value_and_grad(lambda x, w, c=c: moe.moe(x, top_k=2, chunks=c, **w).sum(),
                                                   argnums=(0, 1)))(x, w) for c in (None, (2, ())))
        np.testing.assert_allclose(cut[0], plain[0], rtol=1e-12)
        for a, b in zip(jax.tree.leaves(cut[1]), jax.tree.leaves(plain[1])):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
        with pytest.raises(ValueError, match="does not split into 4 canonical chunks"):
            moe.moe(x, top_k=2, chunks=(4, ()), **w)  # a hidden dim of 6


@pytest.mark.parametrize("tp_chunks", [None, (2, ())], ids=["ep", "ep+tp"])
def test_experts_in_canonical_chunks_of_experts_compute_the_same_moe(tp_chunks):
    """Deterministic ep's chunks of the experts (expert_chunks=(0, Q, Q, ()): all of them on one device), alone and
    with tp's chunks of each expert chunk's hidden dim, give the unchunked block and its gradients, in float64 to
    rounding (an expert's products are the same; the chunks' rows are merged, not summed)."""
    with float64():
        x, w = _random_moe(np.random.default_rng(3))
        plain, cut = (jax.jit(jax.value_and_grad(lambda x, w, c=c, t=t: moe.moe(x, top_k=2, expert_chunks=c, chunks=t,
                                                                             **w).sum(),
                                                   argnums=(0, 1)))(x, w)
                      for c, t in ((None, None), ((0, 2, 2, ()), tp_chunks)))
        np.testing.assert_allclose(cut[0], plain[0], rtol=1e-12)
        for a, b in zip(jax.tree.leaves(cut[1]), jax.tree.leaves(plain[1])):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("packed", [False, True])
def test_pairs_equals_sorted_with_shared_and_idle_experts(packed):
    """Few tokens, several choosing one expert and most experts idle: the unsorted pairs give the sorted
    result, for plain and for packed (MXFP4) experts."""
    from tessera.lower.reference import mxfp4

    x, w = _random_moe(np.random.default_rng(3), t=5, d=64, e=8, f=32, dtype=np.float32)
    w["router_bias"] = jnp.array([9.0, 8.0, 0, 0, 0, 0, -9.0, -9.0])  # experts 0 and 1 shared by every token
    if packed:
        w.update({n: mxfp4.quantize(w[n]) for n in ("gate", "up")})
        w["down"] = mxfp4.quantize(w["down"])
    run = lambda f: jax.jit(lambda x, w: f(x, top_k=3, **w))(x, w)
    pairs, sorted_ = run(moe.moe_pairs), run(moe.moe)
    assert float(jnp.abs(sorted_).max()) > 1.0
    np.testing.assert_allclose(pairs, sorted_, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("t, e, k", [(1, 32, 4), (5, 128, 4), (3, 8, 8), (64, 16, 2), (65, 16, 2)])
def test_choose_top_k_is_lax_top_k(t, e, k):
    """The router's top-k by ranks (few rows) gives jax.lax.top_k's values and indices bit for bit: random logits,
    rows with ties (to the lower index), zeros of both signs (+0.0 ranks above -0.0), infinities and a NaN."""
    from tessera.lower.reference.moe import choose_top_k

    rng = np.random.default_rng(t * 1000 + e)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    logits[0, : e // 2] = 0.5  # a tie across half the row
    if t > 2:
        logits[1, ::3] = -0.0
        logits[1, 1::3] = 0.0
        logits[2, 0], logits[2, -1] = np.inf, -np.inf
        logits[2, 1] = np.nan
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(logits, dtype)
        got, want = jax.jit(lambda a: choose_top_k(a, k))(x), jax.lax.top_k(x, k)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(np.asarray(got[0], np.float32).view(np.int32) if dtype == jnp.float32
                                      else np.asarray(got[0].astype(jnp.float32)),
                                      np.asarray(want[0], np.float32).view(np.int32) if dtype == jnp.float32
                                      else np.asarray(want[0].astype(jnp.float32)))
        assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
