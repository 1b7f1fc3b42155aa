"""Grouped matmul kernel vs jax.lax.ragged_dot: forward and gradients, ragged and empty groups."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.kernels.grouped_matmul import (GroupedMatmulConfig, _grouped, _tile_table,
                                                  grouped_matmul, grouped_matmul_reference)
from tests.lower.kernels._check import assert_close


def _inputs(seed, m, k, n, sizes, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(ks[0], (m, k), dtype)
    rhs = jax.random.normal(ks[1], (len(sizes), k, n), dtype)
    ct = jax.random.normal(ks[2], (m, n), jnp.float32)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), ct


def test_tile_table_covers_every_row_once():
    """Each row up to m lands in exactly one tile, with its own group (tail rows: group G)."""
    sizes = np.array([70, 0, 100, 0, 90], np.int32)
    table = np.asarray(_tile_table(jnp.asarray(sizes), 300, 64))
    owner = np.full(300, -1)
    for grp, blk, first, rows in table:
        rr = np.arange(blk * 64 + first, blk * 64 + first + rows)
        assert (owner[rr] == -1).all()
        owner[rr] = grp
    want = np.concatenate([np.full(s, g) for g, s in enumerate(sizes)] + [np.full(40, 5)])
    np.testing.assert_array_equal(owner, want)


def test_interpret_forward_ragged_empty_and_tail():
    """CPU interpreter: empty experts, groups straddling blocks, rows past sum(sizes) are zero."""
    lhs, rhs, sizes, _ = _inputs(0, 300, 128, 128, [70, 0, 100, 0, 90])
    cfg = GroupedMatmulConfig(block_m=64, block_n=64, block_k=64, stages=2, interpret=True)
    out = _grouped(lhs, rhs, sizes, cfg)
    ref = grouped_matmul_reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    assert_close(out, ref, 1e-2, "out")
    assert float(jnp.abs(out[260:].astype(jnp.float32)).max()) == 0.0


GPU_CASES = [
    (1024, 256, 512, [100, 0, 300, 1, 0, 623]),
    (4096, 2880, 5760, None),  # K=2880, N=5760 as in GPT-OSS
    (640, 128, 192, [0, 0, 0, 600]),  # one expert, 40 tail rows, N not a multiple of 128
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,sizes", GPU_CASES)
def test_gpu_forward_and_grads(m, k, n, sizes):
    """On a Hopper GPU: out, d lhs, d rhs against ragged_dot in fp32."""
    if sizes is None:  # random routing over 16 experts, some likely empty
        ids = np.random.default_rng(m).integers(0, 16, m) ** 2 % 16
        sizes = np.bincount(ids, minlength=16).tolist()
    lhs, rhs, gs, ct = _inputs(len(sizes), m, k, n, sizes)

    def loss(fn, a, b):
        out = fn(a, b, gs)
        return jnp.vdot(out.astype(jnp.float32), ct), out

    grad = lambda fn, a, b: jax.jit(jax.grad(lambda x, y: loss(fn, x, y), argnums=(0, 1),
                                             has_aux=True))(a, b)
    (dl, dr), out = grad(grouped_matmul, lhs, rhs)
    (rl, rr), ref = grad(grouped_matmul_reference, lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    assert_close(out, ref, 1e-2, "out")
    assert_close(dl, rl, 1e-2, "dlhs")
    assert_close(dr, rr, 1e-2, "drhs")
