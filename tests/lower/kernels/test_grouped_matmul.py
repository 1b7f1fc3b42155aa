"""Grouped matmul kernel vs jax.lax.ragged_dot: forward and gradients, ragged and empty groups."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.kernels import grouped_matmul as gm
from tessera.lower.kernels.grouped_matmul import GroupedMatmulConfig, grouped_matmul, grouped_matmul_reference
from tests.lower.kernels._check import assert_close
from tests.lower.kernels._interpret import share_compiles  # noqa: F401 (autouse: one compile per kernel)

SIZES = [40, 0, 70, 0, 10]  # empty experts, groups straddling 8-row and 64-row boundaries, 16 tail rows
INTERPRET = GroupedMatmulConfig(block_n=64, stages=2, band=2, drhs_groups=2, interpret=True)


def _inputs(seed, m, k, n, sizes, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(ks[0], (m, k), dtype)
    rhs = jax.random.normal(ks[1], (len(sizes), k, n), dtype)
    ct = jax.random.normal(ks[2], (m, n), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), ct


def _f32(x):
    return x.astype(jnp.float32)


@pytest.mark.parametrize("m,block_m", [(304, 128), (304, 256), (136, 128)])
def test_tile_table_covers_every_row_once(m, block_m):
    """Each row lands in one tile of its own group (tail rows: group G); tiles fit and start on 8 rows.

    (m is a multiple of 8: grouped_call pads to one.)
    """
    sizes = np.array([70, 0, 100, 0, 90, 3], np.int32)
    sizes = np.minimum(sizes, np.maximum(m - np.concatenate([[0], np.cumsum(sizes)[:-1]]), 0))
    table = np.asarray(gm._tile_table(jnp.asarray(sizes), m, block_m))
    owner = np.full(m, -1)
    for grp, r0, first, rows in table[table[:, 3] > 0]:
        assert r0 % gm.ALIGN == 0 and 0 <= r0 <= m - block_m and first + rows <= block_m
        rr = np.arange(r0 + first, r0 + first + rows)
        assert (owner[rr] == -1).all()
        owner[rr] = grp
    want = np.concatenate([np.full(s, g) for g, s in enumerate(sizes)] + [np.full(m - sizes.sum(), len(sizes))])
    np.testing.assert_array_equal(owner, want)


def test_drhs_table_lists_every_group_row_once():
    """d rhs steps: each group's rows once, an empty group one 0-row step, chunks in order."""
    sizes = jnp.asarray([70, 0, 100, 0, 90], jnp.int32)
    table, lo, hi = (np.asarray(x) for x in gm._drhs_table(sizes, 320, 64, 2))
    seen = {g: [] for g in range(5)}
    for grp, blk, first, rows in table[:hi[-1]]:
        seen[grp] += list(range(blk * 64 + first, blk * 64 + first + rows))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for g, s in enumerate(np.asarray(sizes)):
        assert seen[g] == list(range(starts[g], starts[g] + s))
    assert list(lo) == [0, 3, 6] and list(hi) == [3, 6, 9] and table[hi[-1], 0] == -1


def test_interpret_forward_ragged_empty_and_tail():
    """CPU interpreter: empty experts, groups inside and across tiles, rows past sum(sizes) are zero."""
    lhs, rhs, sizes, _ = _inputs(0, 136, 64, 64, SIZES)
    out = gm.grouped_call(lhs, [rhs], sizes, INTERPRET)
    assert_close(out, grouped_matmul_reference(_f32(lhs), _f32(rhs), sizes), 1e-2, "out")
    assert float(jnp.abs(_f32(out[120:])).max()) == 0.0


def test_interpret_drhs_and_dlhs():
    """CPU interpreter: d rhs (chunks of groups, empty experts give zeros) and d lhs (rhs transposed)."""
    lhs, rhs, sizes, ct = _inputs(1, 136, 64, 64, SIZES)
    _, vjp = jax.vjp(lambda a, b: grouped_matmul_reference(a, b, sizes), _f32(lhs), _f32(rhs))
    want_l, want_r = vjp(_f32(ct))
    drhs = gm.grouped_drhs(lhs, ct, sizes, len(SIZES), INTERPRET)
    assert_close(drhs, want_r, 1e-2, "drhs")
    assert float(jnp.abs(_f32(drhs[1])).max()) == 0.0
    dlhs = gm.grouped_call(ct, [rhs], sizes, INTERPRET, transpose_rhs=True)
    assert_close(dlhs, want_l, 1e-2, "dlhs")


GPU_CASES = [
    (1024, 256, 512, [100, 0, 300, 1, 0, 623]),
    (4096, 2880, 5760, None),  # K=2880, N=5760 as in GPT-OSS
    (640, 128, 192, [0, 0, 0, 600]),  # one expert, 40 tail rows
    (100, 64, 64, [30, 0, 50]),  # fewer rows than a tile, K below a d rhs tile, 20 tail rows
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,sizes", GPU_CASES)
def test_gpu_forward_and_grads(m, k, n, sizes):
    """On a Hopper GPU: out, d lhs, d rhs against ragged_dot in fp32."""
    if sizes is None:  # random routing over 16 experts, some likely empty
        ids = np.random.default_rng(m).integers(0, 16, m) ** 2 % 16
        sizes = np.bincount(ids, minlength=16).tolist()
    lhs, rhs, gs, ct = _inputs(len(sizes), m, k, n, sizes)

    def grads(fn, a, b):
        out, vjp = jax.vjp(lambda a, b: fn(a, b, gs), a, b)
        return (out, *vjp(ct.astype(out.dtype)))

    got = jax.jit(lambda a, b: grads(grouped_matmul, a, b))(lhs, rhs)
    want = jax.jit(lambda a, b: grads(grouped_matmul_reference, a, b))(_f32(lhs), _f32(rhs))
    for name, g, w in zip(["out", "dlhs", "drhs"], got, want):
        assert_close(g, w, 1e-2, name)
