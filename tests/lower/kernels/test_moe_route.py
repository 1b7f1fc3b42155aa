"""The decode routing kernel (kernels/moe_route.py) vs reference.moe.route_blocks: the same experts in the same
slots, the same softmax weights; ties, signed zeros, infinities; with and without a bias."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.kernels.moe_route import RouteConfig, route_blocks, supported
from tessera.lower.reference import moe

INTERPRET = RouteConfig(interpret=True)


def _blocks(seed, t, c, e):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((t, c, e)), jnp.float32)


def _check(blocks, bias, k, config):
    want_w, want_e = moe.route_blocks(blocks, bias, k)
    got_w, got_e = jax.jit(lambda b, s: route_blocks(b, s, k, config=config))(blocks, bias)
    np.testing.assert_array_equal(np.asarray(got_e), np.asarray(want_e))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=2e-6, atol=0)
    assert got_w.dtype == jnp.float32 and got_e.dtype == jnp.int32


def test_route_kernel_matches_reference_with_ties_and_specials():
    """Interpreted, one jit a case: 32 experts in 90 blocks, 3 tokens whose logits tie (equal pairs, -0.0 and
    +0.0, +-inf), a bf16 bias; 5 experts (padded to 8) with 2 blocks, k = 5, no bias."""
    blocks = np.array(_blocks(0, 3, 90, 32))
    blocks[:, 1:] = 0.0  # each token's logits are its first block: exact values to tie
    blocks[0, 0, [3, 7, 9]] = 5.0  # three tied in the top 4: lowest id first
    blocks[1, 0, :4] = [0.0, -0.0, np.inf, -np.inf]
    blocks[1, 0, 4:] = -1.0
    bias = np.random.default_rng(1).standard_normal(32)
    bias[:10] = 0.0  # the ties stay ties
    _check(jnp.asarray(blocks), jnp.asarray(bias, jnp.bfloat16), 4, INTERPRET)
    _check(_blocks(2, 2, 2, 5), None, 5, INTERPRET)


def test_route_kernel_is_what_moe_pairs_uses():
    """The kernel as moe_pairs' routing gives the reference's MoE output bitwise (same experts, same weights)."""
    rng = np.random.default_rng(3)
    d, f, e = 64, 32, 8
    x = jnp.asarray(rng.standard_normal((1, d)), jnp.bfloat16)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16)  # noqa: E731
    args = dict(router=w(d, e), router_bias=w(e), gate=w(e, d, f), up=w(e, d, f), down=w(e, f, d),
                gate_bias=w(e, f), up_bias=w(e, f), down_bias=w(e, d), top_k=4)
    dense = lambda lhs, rhs, experts, preferred_element_type: jnp.stack(  # noqa: E731
        [jnp.dot(lhs[i], rhs[experts[i]], preferred_element_type=preferred_element_type) for i in range(len(experts))])
    pd = lambda lhs, rhs, experts, preferred_element_type: (  # noqa: E731
        tuple(dense(lhs, m, experts, preferred_element_type) for m in rhs) if isinstance(rhs, tuple)
        else dense(lhs, rhs, experts, preferred_element_type))
    kernel = lambda b, s, k: route_blocks(b, s, k, config=INTERPRET)  # noqa: E731
    want = jax.jit(lambda x: moe.moe_pairs(x, **args, pair_dot=pd))(x)
    got = jax.jit(lambda x: moe.moe_pairs(x, **args, pair_dot=pd, route_blocks=kernel))(x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_route_kernel_supported_shapes():
    b = jax.ShapeDtypeStruct((1, 90, 32), jnp.float32)
    assert supported(b, jax.ShapeDtypeStruct((32,), jnp.bfloat16), 4, INTERPRET)
    assert not supported(b, None, 33, INTERPRET)  # k above E
    assert not supported(jax.ShapeDtypeStruct((1, 90, 256), jnp.float32), None, 4, INTERPRET)  # E above 128
    assert not supported(jax.ShapeDtypeStruct((1, 90, 32), jnp.bfloat16), None, 4, INTERPRET)  # fp32 sums only


@pytest.mark.gpu
@pytest.mark.parametrize("t,c,e,k", [(1, 90, 32, 4), (1, 90, 128, 4), (4, 90, 32, 4), (2, 1, 128, 4)])
def test_gpu_route_kernel_matches_reference(t, c, e, k):
    """On a GPU: GPT-OSS-20B's (32 experts) and 120B's (128) decode routing, 1-4 tokens, one block (a dot).
    The blocks are multiples of 2^-10 whose sums are exact in any order, so the logits are the reference's
    and only the exponential (Triton's against XLA's) may differ, in the last bits."""
    rng = np.random.default_rng(t * c + e)
    blocks = jnp.asarray(rng.integers(-2048, 2048, (t, c, e)) / 1024.0, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(e), jnp.bfloat16)
    assert supported(blocks, bias, k)
    want_w, want_e = moe.route_blocks(blocks, bias, k)
    got_w, got_e = jax.jit(lambda b, s: route_blocks(b, s, k))(blocks, bias)
    np.testing.assert_array_equal(np.asarray(got_e), np.asarray(want_e))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-5, atol=0)
