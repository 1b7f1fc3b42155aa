"""Grouped (ragged) matmul for MoE experts on Hopper (Mosaic GPU), forward and backward.

Semantics of `jax.lax.ragged_dot`: lhs [M, K] rows sorted by group, rhs [G, K, N], group_sizes [G]
(sum <= M; rows past the sum give 0; empty groups allowed): out[r] = lhs[r] @ rhs[group(r)].

Forward: a tile table built outside the kernel lists, for every (row block, group) pair that
meets, the group, the block and the rows of the block that belong to it; each CTA runs one table
entry x one N tile: a TMA/wgmma pipeline over K, then stores only its rows (a ladder of
power-of-two TMA stores, so rows of neighbouring groups are never overwritten).
d lhs is the same kernel on rhs^T (a transposed wgmma operand, no copy). d rhs[g] = lhs_g^T dout_g:
one CTA per (group, K tile, N tile), pipelining over the group's row blocks and zeroing rows of
other groups in SMEM on the first and last block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tessera.lower.kernels import _mgpu


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Tiles: block_m rows x block_n columns per CTA, block_k per pipeline step, `stages` deep."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    band: int = 8  # row tiles visited together (L2 reuse of lhs rows and expert weights)
    interpret: bool = False  # CPU interpreter (forward only: it has no transposed wgmma operands)

    def __post_init__(self):
        if self.block_m % 64 or self.block_k % 64:
            raise ValueError(f"block_m={self.block_m}, block_k={self.block_k} must be multiples of 64")
        if self.block_n % 64 or self.block_n > 256:
            raise ValueError(f"{self.block_n=} must be a multiple of 64, at most 256")
        if self.stages < 2:
            raise ValueError(f"{self.stages=} must be at least 2")


def default_config(n: int) -> GroupedMatmulConfig:
    """128 x 128 tiles where N allows, else 128 x 64."""
    return GroupedMatmulConfig(block_n=128 if n % 128 == 0 else 64)


def supported(lhs, rhs, group_sizes, config=None) -> bool:
    """Hopper GPU, fp16/bf16, K and N multiples of 64 (the tiles), int32 group sizes."""
    if not _mgpu.on_hopper():
        return False
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],):
        return False
    if lhs.dtype != rhs.dtype or jnp.dtype(lhs.dtype) not in _mgpu.HALF_DTYPES:
        return False
    cfg = config or default_config(rhs.shape[2])
    return lhs.shape[1] == rhs.shape[1] and lhs.shape[1] % 64 == 0 and rhs.shape[2] % cfg.block_n == 0


def _kernel(body, cfg: GroupedMatmulConfig, **kwargs):
    """plgpu.kernel in warpgroup semantics (or the CPU interpreter)."""
    if cfg.interpret:
        return plgpu.kernel(body, interpret=_mgpu.interpret_params(), **kwargs)
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    return plgpu.kernel(body, compiler_params=params, **kwargs)


def _tile_table(group_sizes, m: int, block_m: int):
    """int32 [cdiv(m, bm) + G, 4]: (group, row block, first row in block, rows) per tile.

    Rows past sum(group_sizes) form a virtual group G whose tiles store zeros (ragged_dot's 0).
    """
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])  # + the tail group
    g = ends.shape[0]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first = starts // block_m
    count = jnp.where(ends > starts, (ends - 1) // block_m - first + 1, 0)
    offsets = jnp.cumsum(count)
    t = jnp.arange(-(-m // block_m) + g - 1, dtype=jnp.int32)
    grp = jnp.minimum(jnp.searchsorted(offsets, t, side="right"), g - 1).astype(jnp.int32)
    blk = first[grp] + t - (offsets[grp] - count[grp])
    lo = jnp.maximum(starts[grp], blk * block_m)
    hi = jnp.minimum(ends[grp], (blk + 1) * block_m)
    rows = jnp.where(t < offsets[-1], jnp.maximum(hi - lo, 0), 0)
    return jnp.stack([grp, blk, lo - blk * block_m, rows], axis=1).astype(jnp.int32)


def _store_rows(o_smem, out_ref, row0, first, rows, col0, block_m: int, block_n: int):
    """Copy o_smem rows [first, first + rows) to out rows [row0 + first, ...): power-of-two TMAs."""
    start, size = first, block_m
    while size >= 1:
        @pl.when(rows & size != 0)
        def _(start=start, size=size):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, size)],
                                    out_ref.at[pl.ds(row0 + start, size), pl.ds(col0, block_n)])
        start = start + (rows & size)
        size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _banded(i, n_tiles_n: int, band: int):
    """Linear CTA id -> (N tile, table entry): `band` row tiles x every N tile, row tiles fastest.

    A band's lhs rows (band x bm x K) and the few experts' weight columns it touches stay in L2, so
    lhs is read about once and each expert's weights about once per band it spans.
    """
    per_band = n_tiles_n * band
    b, r = lax.div(i, jnp.int32(per_band)), lax.rem(i, jnp.int32(per_band))
    return lax.div(r, jnp.int32(band)), b * band + lax.rem(r, jnp.int32(band))


def _forward_kernel(table_ref, lhs_ref, rhs_ref, out_ref, *, cfg, k: int, transpose_rhs: bool,
                    n_tiles_n: int):
    """One (table entry, N tile): acc[bm, bn] = lhs block @ rhs[g] over K, rows of g stored."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    ni, t = _banded(lax.axis_index("i"), n_tiles_n, cfg.band)
    grp, blk, first, rows = (table_ref[t, i] for i in range(4))
    num_groups = rhs_ref.shape[0]

    def acc_scope(acc_ref):
        def step(_, l_smem, r_smem):
            plgpu.wgmma(acc_ref, l_smem, plgpu.transpose_ref(r_smem, (1, 0)) if transpose_rhs else r_smem)

        rhs_spec = (plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk), delay_release=1)
                    if transpose_rhs else
                    plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=1))

        @pl.when(grp < num_groups)  # the tail group stores zeros
        def _():
            plgpu.emit_pipeline(
                step, grid=(k // bk,),
                in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (blk, kk), delay_release=1), rhs_spec],
                max_concurrent_steps=cfg.stages,
            )(lhs_ref, rhs_ref.at[jnp.minimum(grp, num_groups - 1)])
        return acc_ref[...]

    @pl.when(rows > 0)
    def _():
        acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32))

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), out_ref.dtype))
        def _store(o_smem):
            o_smem[...] = acc.astype(o_smem.dtype)
            plgpu.commit_smem()
            _store_rows(o_smem, out_ref, blk * bm, first, rows, ni * bn, bm, bn)


def _grouped(lhs, rhs, group_sizes, cfg: GroupedMatmulConfig, transpose_rhs: bool = False):
    """out [M, N] = ragged lhs @ rhs[g] (rhs [G, K, N] read transposed when transpose_rhs)."""
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    m_pad = -(-m // cfg.block_m) * cfg.block_m
    lhs_p = lhs if m_pad == m else jnp.pad(lhs, ((0, m_pad - m), (0, 0)))
    table = _tile_table(group_sizes, m, cfg.block_m)
    n_t = -(-table.shape[0] // cfg.band) * cfg.band  # whole bands; extra entries have 0 rows
    table = jnp.pad(table, ((0, n_t - table.shape[0]), (0, 0)))
    n_tiles_n = n // cfg.block_n
    out = _kernel(
        functools.partial(_forward_kernel, cfg=cfg, k=k, transpose_rhs=transpose_rhs,
                          n_tiles_n=n_tiles_n), cfg,
        out_type=jax.ShapeDtypeStruct((m_pad, n), lhs.dtype),
        grid=(n_tiles_n * n_t,), grid_names=("i",),
    )(table, lhs_p, rhs)
    return out if m_pad == m else out[:m]


# ----------------------------------------------------------------------------- d rhs


def _drhs_kernel(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, *, cfg):
    """d rhs[g][k tile, n tile] = sum over the group's row blocks of lhs_blk^T @ dout_blk."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    ni, ki, g = lax.axis_index("n"), lax.axis_index("k"), lax.axis_index("g")
    start, end = starts_ref[g], ends_ref[g]
    first_blk = lax.div(start, jnp.int32(bm))
    n_blk = lax.div(end + (bm - 1), jnp.int32(bm)) - first_blk

    def acc_scope(acc_ref):
        def step(idx, l_smem, d_smem):
            row0 = (first_blk + idx[0]) * bm
            edge = (row0 < start) | (row0 + bm > end)

            @pl.when(edge)
            def _():  # zero rows of other groups (first / last block of the group)
                rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bm, bk), 0),
                                         plgpu.Layout.WGMMA) + row0
                keep = ((rows >= start) & (rows < end)).astype(l_smem.dtype)
                l_smem[...] = l_smem[...] * keep
                plgpu.commit_smem()
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(l_smem, (1, 0)), d_smem)

        @pl.when(end > start)
        def _():
            plgpu.emit_pipeline(
                step, grid=(n_blk,),
                in_specs=[plgpu.BlockSpec((bm, bk), lambda i: (first_blk + i, ki), delay_release=1,
                                          transforms=_mgpu.smem_transforms(lhs_ref.dtype)),
                          plgpu.BlockSpec((bm, bn), lambda i: (first_blk + i, ni), delay_release=1,
                                          transforms=_mgpu.smem_transforms(lhs_ref.dtype))],
                max_concurrent_steps=cfg.stages,
            )(lhs_ref, dout_ref)
        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((bk, bn), jnp.float32))  # starts at 0

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bk, bn), out_ref.dtype))
    def _store(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[g, pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _grouped_drhs(lhs, dout, group_sizes, g: int, cfg: GroupedMatmulConfig):
    """d rhs [G, K, N] = per group lhs_g^T @ dout_g."""
    m, k = lhs.shape
    n = dout.shape[1]
    m_pad = -(-m // cfg.block_m) * cfg.block_m
    pad = lambda x: x if m_pad == m else jnp.pad(x, ((0, m_pad - m), (0, 0)))
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return _kernel(
        functools.partial(_drhs_kernel, cfg=cfg), cfg,
        out_type=jax.ShapeDtypeStruct((g, k, n), lhs.dtype),
        grid=(n // cfg.block_n, k // cfg.block_k, g), grid_names=("n", "k", "g"),
    )(starts, ends, pad(lhs), pad(dout))


# ----------------------------------------------------------------------------- public op


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs, rhs, group_sizes, cfg):
    return _grouped(lhs, rhs, group_sizes, cfg)


def _gmm_fwd(lhs, rhs, group_sizes, cfg):
    return _grouped(lhs, rhs, group_sizes, cfg), (lhs, rhs, group_sizes)


def _gmm_bwd(cfg, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    k = lhs.shape[1]
    cfg_t = dataclasses.replace(cfg, block_n=128 if k % 128 == 0 else 64)
    dlhs = _grouped(dout, rhs, group_sizes, cfg_t, transpose_rhs=True)
    drhs = _grouped_drhs(lhs, dout, group_sizes, rhs.shape[0], cfg)
    return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_matmul(lhs, rhs, group_sizes, *, config: GroupedMatmulConfig | None = None):
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` on Hopper tensor cores, with a custom VJP."""
    return _gmm(lhs, rhs, group_sizes.astype(jnp.int32), config or default_config(rhs.shape[2]))


def grouped_matmul_reference(lhs, rhs, group_sizes):
    """The semantics: jax.lax.ragged_dot with fp32 accumulation, output in lhs's dtype."""
    out = lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def main():
    """Times the GPT-OSS expert GEMM (run on a Hopper GPU)."""
    from bench.kernels import run_moe
    run_moe()


if __name__ == "__main__":
    main()
