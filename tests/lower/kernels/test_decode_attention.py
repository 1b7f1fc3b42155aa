"""Decode attention kernel vs reference attention with kv_len, q_offset, sinks and windows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tessera.lower.kernels.decode_attention import (DecodeConfig, decode_attention,
                                                    decode_attention_reference, supported)
from tests.lower.kernels._check import assert_close


def _check(b, sq, hq, hkv, d, t, kv_len, window, with_sinks, config=None, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, hkv, d), jnp.bfloat16)
    sinks = jax.random.normal(ks[3], (hq,), jnp.float32) if with_sinks else None
    assert supported(q, k, v, config=config)
    kv_len = jnp.asarray(kv_len, jnp.int32)
    out = decode_attention(q, k, v, kv_len=kv_len, sinks=sinks, window=window, config=config)
    up = lambda x: x.astype(jnp.float32)
    ref = decode_attention_reference(up(q), up(k), up(v), kv_len=kv_len, sinks=sinks, window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, 2e-2, "out")


def test_interpret_ragged_cache_window_sinks():
    """CPU interpreter: two sequences of different cache lengths, 2 query tokens, window 100."""
    cfg = DecodeConfig(block_kv=64, stages=2, splits=2, interpret=True)
    _check(2, 2, 4, 1, 64, 300, [300, 170], 100, True, config=cfg)


GPU_CASES = [
    (4, 1, 64, 8, 64, 4096, [4096, 1000, 37, 4096], None, True),
    (2, 4, 32, 8, 128, 2000, [2000, 1500], 128, True),
    (1, 1, 8, 1, 64, 70000, [65536], None, False),
    (3, 2, 16, 2, 64, 999, [999, 1, 500], 64, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b,sq,hq,hkv,d,t,kv_len,window,sinks", GPU_CASES)
def test_gpu_matches_reference(b, sq, hq, hkv, d, t, kv_len, window, sinks):
    """On a Hopper GPU: caches up to 64k, ragged kv_len, windows, sinks, head dims 64/128."""
    _check(b, sq, hq, hkv, d, t, kv_len, window, sinks, seed=t)
