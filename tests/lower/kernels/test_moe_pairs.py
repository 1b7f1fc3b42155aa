"""moe_pairs.pairs_ffn (the pairs GEMV reading each token's row for its k copies, then the SwiGLU and the combine
over the GEMVs' split partials) against reference.moe.pairs_ffn, on the interpreter and (marked gpu) at
GPT-OSS-20B's decode shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.kernels import moe_pairs
from tessera.lower.kernels.mxfp4_gemv import GemvConfig
from tessera.lower.reference import moe
from tessera.lower.reference import mxfp4 as ref
from tests.lower.kernels._check import assert_close


def _experts(rng, g: int, k: int, n: int) -> ref.MXFP4:
    """Random packed experts [G, K, N]: every E2M1 code, scales 2^-9..2^-4."""
    return ref.MXFP4(jnp.asarray(rng.integers(0, 256, (g, k // 2, n), dtype=np.uint8)),
                     jnp.asarray(rng.integers(118, 124, (g, k // 32, n), dtype=np.uint8)))


def _case(seed: int, t: int, top_k: int, g: int, d: int, f: int):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
    experts = jnp.asarray(np.stack([rng.choice(g, top_k, replace=False) for _ in range(t)]), jnp.int32)
    weights = jax.nn.softmax(jnp.asarray(rng.standard_normal((t, top_k)), jnp.float32), axis=-1)
    bias = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32)  # noqa: E731
    mats = dict(gate=_experts(rng, g, d, f), up=_experts(rng, g, d, f), down=_experts(rng, g, f, d),
                gate_bias=bias(g, f), up_bias=bias(g, f), down_bias=bias(g, d), act=moe.GPT_OSS_ACT)
    return x, weights, experts, mats


@pytest.mark.parametrize("t,top_k,splits,block", [
    (1, 4, 3, 32),  # one token's four copies: each GEMV's K split three ways, N in several epilogue tiles
    (2, 2, 1, 64),  # two tokens (each GEMV row read for two copies), K unsplit, N off the epilogue tile
])
def test_interpreted_pairs_ffn_is_the_reference(t, top_k, splits, block):
    x, weights, experts, mats = _case(t * 10 + splits, t, top_k, 6, 64, 96)
    cfg = moe_pairs.PairsConfig(block=block, gemv=GemvConfig(block_n=32, splits=splits, interpret=True),
                                interpret=True)
    assert moe_pairs.supported(x, weights, experts, config=cfg, **mats)
    got = jax.jit(functools.partial(moe_pairs.pairs_ffn, config=cfg, **mats))(x, weights, experts)
    want = jax.jit(functools.partial(moe.pairs_ffn, **mats))(x, weights, experts)
    assert got.shape == want.shape == (t, 64) and got.dtype == x.dtype
    # the split-K sums and the epilogues' order against the reference's unsplit products: bf16 outputs a rounding
    # apart at most (the activation's inputs are rounded to bf16 after fp32 sums that differ in their last bits)
    assert_close(got, want, 1e-2, "pairs_ffn")
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))) <= 0.05 * float(
        jnp.max(jnp.abs(want.astype(jnp.float32))))


def test_supported_wants_packed_experts_of_matching_shapes():
    x, weights, experts, mats = _case(0, 1, 4, 6, 64, 96)
    cfg = moe_pairs.PairsConfig(gemv=GemvConfig(block_n=32, interpret=True), interpret=True)
    assert moe_pairs.supported(x, weights, experts, config=cfg, **mats)
    assert not moe_pairs.supported(x, weights, experts, config=cfg, **{**mats, "down": mats["gate"]})
    plain = {**mats, "gate": ref.dequantize(mats["gate"], jnp.bfloat16)}
    assert not moe_pairs.supported(x, weights, experts, config=cfg, **plain)
    assert not moe_pairs.supported(x, weights, experts[:, :2], config=cfg, **mats)  # weights [T, k] as experts
    assert not moe_pairs.supported(x, weights, experts, **mats)  # the CPU without the interpreter


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2])
def test_gpu_pairs_ffn_is_the_reference(t):
    """On a GPU at GPT-OSS-20B's shapes (32 experts, top-4, 2880 wide): the default configuration's GEMVs (K split
    for ~3 programs an SM) and epilogues against the reference."""
    x, weights, experts, mats = _case(t, t, 4, 32, 2880, 2880)
    assert moe_pairs.supported(x, weights, experts, **mats)
    got = jax.jit(functools.partial(moe_pairs.pairs_ffn, **mats))(x, weights, experts)
    want = jax.jit(functools.partial(moe.pairs_ffn, **mats))(x.astype(jnp.float32), weights, experts)
    assert_close(got, want, 1e-2, "pairs_ffn")
