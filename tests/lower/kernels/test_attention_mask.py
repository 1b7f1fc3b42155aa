"""Block ranges of MaskSpec against brute-force visibility of every (query, key) pair."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.kernels.attention_mask import MaskSpec

BLOCK = 8
CASES = [  # (causal, window, q_offset, rows, kv_len)
    (True, None, 0, 40, 40), (True, 5, 0, 40, 40), (True, 13, 0, 40, 37), (False, None, 0, 24, 29),
    (True, 9, 16, 24, 40), (True, None, 5, 24, 29), (False, 11, 3, 24, 40), (True, 7, 0, 40, 40),
    (True, 10, 3, 24, 40), (True, 23, 0, 40, 40), (False, 15, 0, 24, 40),
]


def _visible(spec: MaskSpec, rows: int, keys: int) -> np.ndarray:
    p = np.arange(rows)[:, None] + spec.q_offset
    j = np.arange(keys)[None, :]
    return np.broadcast_to(np.asarray(spec.visible(jnp.asarray(p), jnp.asarray(j))), (rows, keys))


@pytest.mark.parametrize("causal,window,q_offset,rows,kv_len", CASES)
def test_block_ranges_match_pairwise_visibility(causal, window, q_offset, rows, kv_len):
    """key_range/full_range (query tiles) and query_range/full_query_range (key tiles): every
    block with a visible pair is in range, and a block is "full" exactly when all its pairs are."""
    spec = MaskSpec(causal=causal, window=window, q_offset=q_offset, kv_len=kv_len)
    keys = -(-kv_len // BLOCK) * BLOCK
    vis = _visible(spec, rows, keys)
    n_q, n_k = rows // BLOCK, keys // BLOCK
    block = lambda qb, kb: vis[qb * BLOCK:(qb + 1) * BLOCK, kb * BLOCK:(kb + 1) * BLOCK]
    for qb in range(n_q):
        p0 = qb * BLOCK + q_offset
        lo, hi = (int(x) for x in spec.key_range(jnp.int32(p0), jnp.int32(p0 + BLOCK - 1), BLOCK))
        a, b = (int(x) for x in spec.full_range(jnp.int32(p0), jnp.int32(p0 + BLOCK - 1), BLOCK,
                                                 jnp.int32(lo), jnp.int32(hi)))
        for kb in range(n_k):
            assert not block(qb, kb).any() or lo <= kb < hi, (qb, kb)
            if lo <= kb < hi:
                assert (a <= kb < b) == bool(block(qb, kb).all()), (qb, kb, a, b)
    for kb in range(n_k):
        k0 = kb * BLOCK
        lo, hi = (int(x) for x in spec.query_range(jnp.int32(k0), jnp.int32(k0 + BLOCK - 1), BLOCK, n_q))
        a, b = (int(x) for x in spec.full_query_range(jnp.int32(k0), jnp.int32(k0 + BLOCK - 1), BLOCK,
                                                       jnp.int32(lo), jnp.int32(hi)))
        for qb in range(n_q):
            assert not block(qb, kb).any() or lo <= qb < hi, (kb, qb)
            if lo <= qb < hi:
                assert (a <= qb < b) == bool(block(qb, kb).all()), (kb, qb, a, b)


@pytest.mark.parametrize("causal,window", [(True, None), (True, 6), (False, None)])
def test_key_ranges_of_front_padding_stay_in_bounds(causal, window):
    """The forward pads causal queries in front: positions start at q_offset = -21. Key ranges
    of such tiles never leave [0, key blocks] and still cover every visible block."""
    spec = MaskSpec(causal=causal, window=window, q_offset=-21, kv_len=30)
    n_k = -(-30 // BLOCK)
    vis = _visible(spec, 56, n_k * BLOCK)
    for qb in range(56 // BLOCK):
        p0 = qb * BLOCK - 21
        lo, hi = (int(x) for x in spec.key_range(jnp.int32(p0), jnp.int32(p0 + BLOCK - 1), BLOCK))
        assert 0 <= lo <= hi <= n_k, (qb, lo, hi)
        for kb in range(n_k):
            assert not vis[qb * BLOCK:(qb + 1) * BLOCK, kb * BLOCK:(kb + 1) * BLOCK].any() or lo <= kb < hi


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 7, 10, 11, 12, 20])
@pytest.mark.parametrize("rows", [4, 8])
def test_may_have_full_blocks_is_exact(causal, window, rows):
    """Whether some tile of `rows` queries (at any position) has a fully visible BLOCK-key block:
    the static test the forward uses to run one masked loop against every tile of 96 positions."""
    spec = MaskSpec(causal=causal, window=window, q_offset=0, kv_len=96, keys_padded=False)
    vis = _visible(spec, 96, 96)
    any_full = any(vis[r0:r0 + rows, kb * BLOCK:(kb + 1) * BLOCK].all()
                   for r0 in range(96 - rows + 1) for kb in range(96 // BLOCK))
    assert spec.may_have_full_blocks(rows, BLOCK) == any_full


@pytest.mark.parametrize("causal,window,q_offset,rows,kv_len", CASES + [(True, 8, 0, 40, 40), (False, None, 0, 24, 20)])
def test_half_edges_drop_only_invisible_halves(causal, window, q_offset, rows, kv_len):
    """Query tiles of half a block's height (the forward's 64-row warpgroups against 128-key
    blocks): an edge block run at half width must hold no visible pair in the half it drops, and
    where a half is empty of visible pairs the edge is taken (the causal diagonal's upper rows)."""
    spec = MaskSpec(causal=causal, window=window, q_offset=q_offset, kv_len=kv_len)
    n_k = -(-kv_len // BLOCK)
    vis = _visible(spec, rows, n_k * BLOCK)
    half, taken = BLOCK // 2, 0
    for r0 in range(0, rows, half):
        p0 = jnp.int32(r0 + q_offset)
        p1 = p0 + half - 1
        lo, hi = spec.key_range(p0, p1, BLOCK)
        full_lo, full_hi = spec.full_range(p0, p1, BLOCK, lo, hi)
        up, down = spec.half_edges(p0, p1, BLOCK, lo, full_lo, full_hi, hi)
        lo, hi, full_lo, full_hi, down = int(lo), int(hi), int(full_lo), int(full_hi), int(down)
        up = 0 if up is None else int(up)
        tile = vis[r0:r0 + half]
        if up:
            assert lo < full_lo and not tile[:, lo * BLOCK:lo * BLOCK + half].any(), (r0, lo)
        if down:
            assert full_hi < hi and not tile[:, (hi - 1) * BLOCK + half:hi * BLOCK].any(), (r0, hi)
        assert up + down <= hi - lo
        if hi > lo and full_hi < hi and not tile[:, (hi - 1) * BLOCK + half:hi * BLOCK].any():
            assert down, (r0, hi)
        if window is not None and lo < full_lo and not tile[:, lo * BLOCK:lo * BLOCK + half].any():
            assert up, (r0, lo)
        taken += up + down
    if causal and q_offset % half == 0:
        assert taken > 0  # the diagonal's upper rows at least


@pytest.mark.parametrize("causal,window,q_offset,rows,kv_len", CASES + [(True, 6, -13, 24, 20)])
@pytest.mark.parametrize("keys_padded", [True, False])
@pytest.mark.parametrize("diff_tile", [True, False])
def test_visibility_is_the_definition_and_tiles_agree(causal, window, q_offset, rows, kv_len, keys_padded,
                                                      diff_tile):
    """visible() is the module's definition (j < kv_len, causal j <= p, window p - j < window),
    and tile() (either orientation, with or without the q - k tile and its unsigned window
    test) gives it for a tile's positions."""
    spec = MaskSpec(causal=causal, window=window, q_offset=q_offset, kv_len=kv_len, keys_padded=keys_padded,
                    diff_tile=diff_tile)
    keys = -(-kv_len // BLOCK) * BLOCK
    p = np.arange(rows)[:, None] + q_offset
    j = np.arange(keys)[None, :]
    want = np.ones((rows, keys), bool)
    if keys_padded:
        want &= j < kv_len
    if causal:
        want &= j <= p
    if window is not None:
        want &= p - j < window
    np.testing.assert_array_equal(_visible(spec, rows, keys), want)
    for q0, k0 in ((0, 0), (8, 16), (16, 8)):
        shape = (rows - q0, keys - k0)
        got = spec.tile(jnp.int32(q0 + q_offset), jnp.int32(k0), shape, interpret=True)
        np.testing.assert_array_equal(np.asarray(got), want[q0:, k0:])
        got_t = spec.tile(jnp.int32(q0 + q_offset), jnp.int32(k0), shape[::-1], interpret=True, transposed=True)
        np.testing.assert_array_equal(np.asarray(got_t), want[q0:, k0:].T)
