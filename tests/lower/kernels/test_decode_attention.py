"""Decode attention kernel vs reference attention with kv_len, q_offset, sinks and windows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tessera.lower.kernels.decode_attention import (DecodeConfig, _persistent_plan, _resolved, _Work,
                                                    decode_attention, decode_attention_reference,
                                                    supported)
from tests.lower.kernels._check import assert_close
from tests.lower.kernels._interpret import share_compiles  # noqa: F401 (autouse: one compile per kernel)


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


def _interp(**kw):
    return DecodeConfig(block_kv=64, stages=2, interpret=True, **kw)


def test_persistent_is_default_and_schedule_covers_every_item_once():
    """CTA c runs items c, c + grid, ...: each (batch, chunk, head) exactly once, heads fastest."""
    assert DecodeConfig().persistent
    work = _Work(bsz=3, hkv=2, splits=3, grid=4)
    seen = [tuple(int(x) for x in work.item(jnp.int32(c), jnp.int32(i)))
            for c in range(4) for i in range(int(work.count(jnp.int32(c))))]
    assert sorted(seen) == [(b, h, c) for b in range(3) for h in range(2) for c in range(3)]
    assert [int(work.count(jnp.int32(c))) for c in range(4)] == [5, 5, 4, 4]
    assert seen[:2] == [(0, 0, 0), (0, 0, 2)]  # CTA 0: items 0 and 4 = (b 0, chunk 2, head 0)


def test_default_splits_fill_one_wave_of_ctas():
    """splits=None: B * Hkv * splits items fit the CTAs (at least one chunk, at most one a block)."""
    cfg = DecodeConfig(num_ctas=132)
    assert _resolved(cfg, 8, 8, 4096, 1, None).splits == 2  # 128 items
    assert _resolved(cfg, 1, 8, 4096, 1, None).splits == 16
    assert _resolved(cfg, 32, 8, 4096, 1, None).splits == 1  # more heads than CTAs
    assert _resolved(cfg, 1, 8, 300, 1, None).splits == 3  # a 3-block cache
    assert _resolved(cfg, 1, 8, 65536, 1, 128).splits == 2  # a 128-key window spans <= 2 blocks
    assert _resolved(cfg, 1, 8, 65536, 4, 128).splits == 3  # 4 tokens: 131 keys, <= 3 blocks
    assert _resolved(DecodeConfig(splits=5), 8, 8, 4096, 1, None).splits == 5


@pytest.mark.parametrize("d,bkv,lanes,stages,n_out", [(64, 128, 2, 2, 2), (64, 256, 2, 2, 1),
                                                      (64, 64, 2, 4, 2), (128, 128, 1, 2, 1)])
def test_persistent_plan_fits_smem_and_gives_each_slot_one_warpgroup(d, bkv, lanes, stages, n_out):
    """Two compute warpgroups where their Q and output slots fit beside a 2-deep ring, and a ring
    depth that is a multiple of them: ring slot s always serves warpgroup s % 2 (each warpgroup
    tracks the phases of the barriers it waits on; a slot shared by both deadlocks or races)."""
    cfg, got_n_out = _persistent_plan(DecodeConfig(block_kv=bkv), d, jnp.bfloat16)
    assert (cfg.compute_warpgroups, cfg.stages, got_n_out) == (lanes, stages, n_out)
    q_slot, o_slot = 64 * (d * 2 + 4), 64 * (d + 1) * 4
    smem = lanes * (2 * q_slot + n_out * o_slot) + 2 * stages * bkv * d * 2
    assert smem <= 200 * 1024


def test_interpret_one_compute_warpgroup_window_inside_chunks():
    """compute_warpgroups=1, one chunk. kv_len 500, window 150: keys 350-499 in 64-key blocks 5-7,
    i.e. a masked head (window start), an unmasked middle and a masked tail (kv_len)."""
    _check(2, 1, 8, 2, 64, 640, [640, 500], 150, True,
           config=_interp(splits=1, compute_warpgroups=1))


def test_interpret_persistent_many_items_empty_chunks_sinks():
    """18 items on 2 CTAs (the ring, Q and output slots wrap many times); the kv_len 60 sequence
    has one visible block, so two of its three chunks are empty (lse -inf) and must be ignored."""
    _check(3, 1, 8, 2, 64, 320, [320, 60, 200], None, True, config=_interp(splits=3))


def test_interpret_persistent_two_tokens_small_window_no_sinks():
    """2 query tokens, a 40-key window inside one 64-key block, 8 items on 3 CTAs (3, 3, 2)."""
    _check(2, 2, 4, 2, 64, 300, [300, 170], 40, False, config=_interp(splits=2, num_ctas=3))


def test_interpret_persistent_head_dim_128():
    """Head dim 128 with 128-key tiles: one output slot beside a 2-deep ring (~193 KiB of SMEM)."""
    cfg = DecodeConfig(block_kv=128, stages=4, splits=2, interpret=True)
    _check(2, 1, 4, 1, 128, 384, [384, 130], 200, True, config=cfg)


def test_interpret_grid_ragged_cache_window_sinks():
    """persistent=False: two sequences of different cache lengths, 2 query tokens, window 100."""
    _check(2, 2, 4, 1, 64, 300, [300, 170], 100, True, config=_interp(splits=2, persistent=False))


GPU_CASES = [
    (4, 1, 64, 8, 64, 4096, [4096, 1000, 37, 4096], None, True),
    (2, 4, 32, 8, 128, 2000, [2000, 1500], 128, True),
    (1, 1, 8, 1, 64, 70000, [65536], None, False),
    (3, 2, 16, 2, 64, 999, [999, 1, 500], 64, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("b,sq,hq,hkv,d,t,kv_len,window,sinks", GPU_CASES)
def test_gpu_matches_reference(b, sq, hq, hkv, d, t, kv_len, window, sinks, persistent):
    """On a Hopper GPU: caches up to 64k, ragged kv_len, windows, sinks, head dims 64/128."""
    _check(b, sq, hq, hkv, d, t, kv_len, window, sinks, config=DecodeConfig(persistent=persistent),
           seed=t)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [DecodeConfig(splits=16), DecodeConfig(block_kv=64, splits=3),
                                 DecodeConfig(block_kv=256, stages=2, num_ctas=7),
                                 DecodeConfig(compute_warpgroups=1, splits=4)])
def test_gpu_persistent_configs(cfg):
    """On a Hopper GPU: the persistent kernel with other splits, tiles and grids (sweep candidates)."""
    _check(8, 1, 64, 8, 64, 4096, [4096, 3000, 129, 4096, 1, 2048, 4095, 64], None, True,
           config=cfg, seed=1)


@pytest.mark.parametrize("d,persistent", [(64, True), (128, True), (64, False)])
def test_lowers_for_hopper(d, persistent):
    """The real Mosaic GPU lowering (no GPU needed) accepts both kernels: register layouts, SMEM
    slots and TMA shapes are checked here, which the interpreter does not do."""
    cfg = DecodeConfig(persistent=persistent, num_ctas=132)
    q = jax.ShapeDtypeStruct((8, 1, 64, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((8, 1000, 8, d), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((64,), jnp.float32)
    fn = lambda q, k, v, s: decode_attention(q, k, v, sinks=s, window=300, config=cfg)
    text = jax.jit(fn).trace(q, kv, kv, sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
