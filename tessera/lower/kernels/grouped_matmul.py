"""Grouped (ragged) matmul for MoE experts on Hopper (Mosaic GPU), forward and backward.

Semantics of `jax.lax.ragged_dot`: lhs [M, K] rows sorted by group, rhs [G, K, N], group_sizes [G]
(sum <= M; rows past the sum give 0; empty groups allowed): out[r] = lhs[r] @ rhs[group(r)].

Forward (and d lhs, the same kernel reading rhs transposed): a persistent grid, one CTA per SM,
walks (row tile, N tile) pairs in bands (`_banded`). Row tiles follow their group: they start at
the group's first row rounded down to 8 (TMA tiles start on the SMEM tiling's 8-row boundary), so
a group of s rows takes about ceil(s / block_m) tiles instead of one per block it touches; a tile
that would run past M is shifted back. Each CTA has a TMA producer warpgroup and two consumer
warpgroups (`emit_pipeline_warp_specialized`), each owning half of the tile's rows; a consumer
whose half holds none of the tile's rows skips its MMAs. The epilogue writes the tile through SMEM
and stores only the tile's own rows (a ladder of power-of-two TMA stores, so neighbouring groups
are never overwritten) while the producer already loads the next tile.
d rhs[g] = lhs_g^T @ dout_g (`grouped_drhs`): persistent over (chunk of groups, K tile, N tile);
one pipeline walks the chunk's 64-row blocks, zeroing rows of other groups in SMEM, and writes
(then restarts) the accumulator after each group's last block.
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
from tessera.lower.kernels._tables import cumsum
from tessera.lower.kernels._vma import common, like

MEMORY_REGISTERS = 40  # the TMA warpgroup's registers; the consumers share the rest
WGS = 2  # consumer warpgroups per CTA
ALIGN = 8  # row tiles start on multiples of 8 (the SMEM tiling's row count)


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """block_m rows (block_m // 2 per consumer) x block_n columns per tile; block_k per step."""
    block_m: int = 128
    block_n: int = 192
    block_k: int = 64
    stages: int = 3  # H200, 2880 -> 5760: 3 stages 2.60 ms, 4 stages 2.70 ms
    band: int = 8  # row tiles visited together (L2 reuse of lhs rows and expert weights)
    skip_idle: bool = True  # a consumer whose half of the tile has no rows issues no MMAs
    drhs_groups: int = 4  # d rhs: groups summed by one pipeline (the producer never stalls between them)
    drhs_stages: int = 4  # d rhs pipeline depth (3 stages: 3.54 ms, 4: 3.40 ms)
    interpret: bool = False  # the CPU interpreter (tests)

    def __post_init__(self):
        if self.block_m not in (128, 256):
            raise ValueError(f"{self.block_m=} must be 128 or 256 (64 or 128 rows per consumer)")
        if self.block_k % 64 or self.block_n % 64 or self.block_n > 256:
            raise ValueError(f"{self.block_k=}, {self.block_n=} must be multiples of 64 (block_n <= 256)")
        if min(self.stages, self.drhs_stages) < 2:
            raise ValueError(f"{self.stages=}, {self.drhs_stages=} must be at least 2")


def pick_block_n(n: int, widths=(192, 128, 64)) -> int:
    """The first width dividing n (GPT-OSS: 2880 and 5760 both take 192)."""
    return next((w for w in widths if n % w == 0), 64)


def default_config(n: int) -> GroupedMatmulConfig:
    """128-row tiles, N tile 192/128/64, whichever divides n first."""
    return GroupedMatmulConfig(block_n=pick_block_n(n))


def supported(lhs, rhs, group_sizes, config=None) -> bool:
    """Hopper GPU, fp16/bf16, K and N multiples of 64, int32-able group sizes."""
    if not _mgpu.on_hopper():
        return False
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],):
        return False
    if lhs.dtype != rhs.dtype or jnp.dtype(lhs.dtype) not in _mgpu.HALF_DTYPES:
        return False
    return lhs.shape[1] == rhs.shape[1] and lhs.shape[1] % 64 == 0 and rhs.shape[2] % 64 == 0


def kernel_call(body, cfg, **kwargs):
    """plgpu.kernel: a persistent grid of 3 warpgroups (2 consumers + TMA), warpgroup semantics."""
    kwargs.update(grid=(_mgpu.num_sms(cfg.interpret, fallback=4),), grid_names=("sm",), num_threads=WGS + 1,
                  thread_name="wg")
    if cfg.interpret:
        return plgpu.kernel(body, interpret=_mgpu.interpret_params(), **kwargs)
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    return plgpu.kernel(body, compiler_params=params, **kwargs)


def transforms(dtype):
    """(8, 64) tiling + 128-byte swizzle for fp16/bf16 SMEM tiles (wgmma and TMA full speed)."""
    return _mgpu.smem_transforms(dtype)


def mma(acc_ref, a, b, *, transpose_a=False, transpose_b=False, scratch=None):
    """acc_ref += a @ b on SMEM tiles (a^T / b^T when asked), on the tensor cores.

    The interpreter of jax 0.10/0.11 has no transposed operands: there `scratch` (an SMEM tile
    of the transposed shape) receives a copy of the transposed operand first.
    """
    if scratch is not None:
        src = a if transpose_a else b
        scratch[...] = src[...].T
        a, b = (scratch, b) if transpose_a else (a, scratch)
        transpose_a = transpose_b = False
    a = _mgpu.transposed(a) if transpose_a else a
    b = _mgpu.transposed(b) if transpose_b else b
    plgpu.wgmma(acc_ref, a, b)


def interpret_scratch(cfg, shape, dtype):
    """Per-consumer SMEM for `mma`'s transposed copies in the interpreter (none on the GPU)."""
    return plgpu.SMEM((WGS, *shape), dtype) if cfg.interpret else None


# ----------------------------------------------------------------------------- tile table


def _tile_table(group_sizes, m: int, block_m: int, align: int = ALIGN):
    """int32 [m // block_m + G + 2, 4]: (group, first row loaded, first kept row in tile, rows).

    Group g's rows [s, e) take tiles starting at s' = s rounded down to `align` (TMA tiles start on
    an 8-row boundary), s' + bm, ...; a tile is loaded from r0 = min(start, m - bm) so it never
    reads past m (m is a multiple of `align`), and keeps rows [max(s, start) - r0, + rows).
    Rows past sum(group_sizes) form group G, whose tiles store zeros. Unused entries have 0 rows.
    """
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(cumsum(sizes), m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])  # + the tail group
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    base = starts // align * align
    count = jnp.where(ends > starts, (ends - base + block_m - 1) // block_m, 0)  # tiles per group
    offsets = cumsum(count)
    t = jnp.arange(m // block_m + ends.shape[0] + 1, dtype=jnp.int32)
    # compare_all: one fused comparison; the default binary search is a device loop of small kernels
    grp = jnp.searchsorted(offsets, t, side="right", method="compare_all")
    grp = jnp.minimum(grp, ends.shape[0] - 1).astype(jnp.int32)
    start = base[grp] + (t - offsets[grp] + count[grp]) * block_m
    lo = jnp.maximum(starts[grp], start)
    rows = jnp.where(t < offsets[-1], jnp.clip(jnp.minimum(ends[grp], start + block_m) - lo, 0, block_m), 0)
    r0 = jnp.clip(jnp.minimum(start, m - block_m), 0, None)
    return jnp.stack([grp, r0, lo - r0, rows], axis=1).astype(jnp.int32)


def _banded(i, n_tiles_n: int, band: int):
    """Linear tile id -> (N tile, table entry): `band` row tiles x every N tile, row tiles fastest.

    A band's lhs rows and the few experts' weight columns it touches stay in L2: lhs is read
    about once and each expert's weights about once (its 2-3 row tiles run side by side).
    """
    per_band = n_tiles_n * band
    b, r = lax.div(i, jnp.int32(per_band)), lax.rem(i, jnp.int32(per_band))
    return lax.div(r, jnp.int32(band)), b * band + lax.rem(r, jnp.int32(band))


def store_rows(o_smem, out_ref, row0, first, rows, col0, height: int, width: int):
    """TMA-store o_smem rows [first, first + rows) to out rows [row0 + first, ...): 2^i-row pieces."""
    start, size = first, 1 << (height.bit_length() - 1)
    while size >= 1:
        @pl.when(rows & size != 0)
        def _(start=start, size=size):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, size)],
                                    out_ref.at[pl.ds(row0 + start, size), pl.ds(col0, width)])
        start = start + (rows & size)
        size //= 2


# ----------------------------------------------------------------------------- forward


def _rhs_tile(rhs_ref, g, ni, bn: int, transpose_rhs: bool):
    """rhs[g]'s columns [ni * bn, + bn): [K, bn], or rows of the [N, K] matrix read transposed."""
    view = rhs_ref.at[g]
    return view.at[pl.ds(ni * bn, bn), :] if transpose_rhs else view.at[:, pl.ds(ni * bn, bn)]


def _forward_pipeline(body, context, *, cfg, k: int, dtype, n_rhs: int, transpose_rhs: bool):
    """The K loop of one tile: lhs [bm, bk] and n_rhs rhs tiles per step, TMA-fed by warpgroup 2."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tf = transforms(dtype)
    specs = [plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=tf)]
    rhs_spec = (plgpu.BlockSpec((bn, bk), lambda kk: (0, kk), transforms=tf) if transpose_rhs else
                plgpu.BlockSpec((bk, bn), lambda kk: (kk, 0), transforms=tf))
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k // bk,), memory_registers=MEMORY_REGISTERS, in_specs=specs + [rhs_spec] * n_rhs,
        wg_axis="wg", num_compute_wgs=WGS, max_concurrent_steps=cfg.stages, compute_context=context)


def _forward_kernel(table_ref, lhs_ref, *refs, cfg, k: int, n_rhs: int, transpose_rhs: bool,
                    n_tiles_n: int, n_entries: int, epilogue):
    """Persistent loop over (table entry, N tile); `epilogue(accs, grp=, ni=, ...)` -> fp32 tile."""
    rhs_refs, extra, out_ref = refs[:n_rhs], refs[n_rhs:-1], refs[-1]
    bm, bn = cfg.block_m, cfg.block_n
    hm = bm // WGS  # rows per consumer warpgroup
    num_groups = rhs_refs[0].shape[0]
    pipeline = functools.partial(_forward_pipeline, cfg=cfg, k=k, dtype=lhs_ref.dtype, n_rhs=n_rhs,
                                 transpose_rhs=transpose_rhs)
    ignore = lambda *_, **__: None
    allocs = pipeline(ignore, ignore).get_allocations(
        lhs_ref.at[pl.ds(0, bm)], *[_rhs_tile(r, 0, 0, bn, transpose_rhs) for r in rhs_refs])
    bk = cfg.block_k
    t_scr = interpret_scratch(cfg, (bk, bn), lhs_ref.dtype) if transpose_rhs else None

    @functools.partial(pl.run_scoped, allocs=allocs, o_smem=plgpu.SMEM((WGS, hm, bn), out_ref.dtype),
                       t_scr=t_scr, collective_axes="wg")
    def _scope(allocs, o_smem, t_scr):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((n_entries * n_tiles_n,), collective_axes="sm")
        def _tile(info):
            ni, t = _banded(info.index[0], n_tiles_n, cfg.band)
            grp, r0, first, rows = (table_ref[t, i] for i in range(4))
            r0 = pl.multiple_of(r0, ALIGN)
            lo = jnp.clip(first - wg * hm, 0, hm)  # this consumer's rows [lo, hi) of its half
            cnt = jnp.clip(first + rows - wg * hm, 0, hm) - lo
            busy = (grp < num_groups) & ((cnt > 0) if cfg.skip_idle else True)

            def body(_, a_smem, *rest):
                *b_smems, accs = rest

                @pl.when(busy)
                def _():
                    for acc, b in zip(accs, b_smems):
                        mma(acc, a_smem.at[pl.ds(wg * hm, hm)], b, transpose_b=transpose_rhs,
                            scratch=None if t_scr is None else t_scr.at[wg])
                    plgpu.wgmma_wait(0)
                return accs

            def context(run):
                def with_accs(*acc_refs):
                    accs = run(acc_refs)
                    tile = epilogue([a[...] for a in accs], grp=grp, ni=ni, extra=extra, num_groups=num_groups,
                                    bn=bn, interpret=cfg.interpret)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store
                    o_smem[wg] = tile.astype(o_smem.dtype)
                    plgpu.commit_smem()
                    store_rows(o_smem.at[wg], out_ref, r0 + wg * hm, lo, cnt, ni * bn, hm, bn)
                pl.run_scoped(with_accs, *[plgpu.ACC((hm, bn), jnp.float32)] * n_rhs)

            @pl.when(rows > 0)
            def _():
                g = jnp.minimum(grp, num_groups - 1)
                views = [_rhs_tile(r, g, ni, bn, transpose_rhs) for r in rhs_refs]
                pipeline(body, context)(lhs_ref.at[pl.ds(r0, bm)], *views, allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def plain_epilogue(accs, **_):
    """The product itself (fp32 accumulator; cast to the output dtype by the caller)."""
    return accs[0]


def grouped_call(lhs, rhs_list, group_sizes, cfg: GroupedMatmulConfig, *, transpose_rhs=False,
                 epilogue=plain_epilogue, extra=(), out_dtype=None):
    """out [M, N] = epilogue(ragged lhs @ rhs[g] for rhs in rhs_list) (rhs [G, K, N], or [G, N, K]^T)."""
    m, k = lhs.shape
    n = rhs_list[0].shape[1] if transpose_rhs else rhs_list[0].shape[2]
    if n % cfg.block_n or k % cfg.block_k:
        raise ValueError(f"N={n}, K={k} must be multiples of {cfg.block_n=}, {cfg.block_k=}")
    m_run = max(-(-m // ALIGN) * ALIGN, cfg.block_m)  # tiles start on 8-row boundaries, fit in the array
    lhs_p = lhs if m_run == m else jnp.pad(lhs, ((0, m_run - m), (0, 0)))
    table = _tile_table(group_sizes, m_run, cfg.block_m)
    n_entries = -(-table.shape[0] // cfg.band) * cfg.band  # whole bands; extra entries have 0 rows
    table = jnp.pad(table, ((0, n_entries - table.shape[0]), (0, 0)))
    n_tiles_n = n // cfg.block_n
    body = functools.partial(_forward_kernel, cfg=cfg, k=k, n_rhs=len(rhs_list), transpose_rhs=transpose_rhs,
                             n_tiles_n=n_tiles_n, n_entries=n_entries, epilogue=epilogue)
    out = kernel_call(body, cfg, out_type=jax.ShapeDtypeStruct((m_run, n), out_dtype or lhs.dtype))(
        table, lhs_p, *rhs_list, *extra)
    return out if m_run == m else out[:m]


# ----------------------------------------------------------------------------- d rhs


def _iota(shape, interpret: bool):
    """int32 row index of a [rows, cols] tile (in the wgmma layout on the GPU)."""
    x = lax.broadcasted_iota(jnp.int32, shape, 0)
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def _drhs_table(group_sizes, m: int, br: int, per_chunk: int):
    """Steps of d rhs: ([E + 1, 4] (group, row block, first row, rows), [C] first step, [C] end).

    Each group lists the br-row blocks its rows [s, e) touch (a block shared by two groups is
    listed for both); an empty group lists one block with 0 rows, so its d rhs is written (zeros).
    Chunk c (groups [c * per_chunk, ...)) owns steps [lo[c], hi[c]). The last row is a sentinel.
    """
    ends = jnp.minimum(cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first_blk = jnp.minimum(starts // br, m // br - 1)
    count = jnp.where(ends > starts, (ends - 1) // br - first_blk + 1, 1)
    offsets = cumsum(count)
    g = group_sizes.shape[0]
    t = jnp.arange(m // br + g + 1, dtype=jnp.int32)
    grp = jnp.minimum(jnp.searchsorted(offsets, t, side="right", method="compare_all"), g - 1)
    grp = grp.astype(jnp.int32)
    blk = first_blk[grp] + t - (offsets[grp] - count[grp])
    lo = jnp.maximum(starts[grp], blk * br)
    rows = jnp.clip(jnp.minimum(ends[grp], (blk + 1) * br) - lo, 0, br)
    live = t < offsets[-1]
    table = jnp.stack([jnp.where(live, grp, -1), jnp.where(live, blk, 0), lo - blk * br, jnp.where(live, rows, 0)], 1)
    firsts = offsets - count
    c = jnp.arange(0, g, per_chunk)
    hi = jnp.concatenate([firsts[c[1:]], offsets[-1:]])
    return table.astype(jnp.int32), firsts[c].astype(jnp.int32), hi.astype(jnp.int32)


DRHS_ROWS = 64  # d rhs: rows per pipeline step (the reduction)


def _drhs_pipeline(body, context, lo, steps, *, cfg, table_ref, dtype):
    """Steps [lo, lo + steps) of the d rhs table: lhs [64 rows, 128 K] and dout [64 rows, bn] tiles."""
    br, bk, tf = DRHS_ROWS, 64 * WGS, transforms(dtype)
    specs = [plgpu.BlockSpec((br, bk), lambda i: (table_ref[lo + i, 1], 0), transforms=tf),
             plgpu.BlockSpec((br, cfg.block_n), lambda i: (table_ref[lo + i, 1], 0), transforms=tf)]
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(steps,), memory_registers=MEMORY_REGISTERS, in_specs=specs, wg_axis="wg",
        num_compute_wgs=WGS, max_concurrent_steps=cfg.drhs_stages, compute_context=context)


def _drhs_tile(i, wg, n_tiles_k: int, n_tiles_n: int, kdim: int):
    """Linear tile id -> (chunk, K tile start, N tile, this consumer's first K row, writes it?).

    Chunk-major (a chunk's rows stay in L2 while its tiles run). The last K tile is shifted back
    to end at kdim (>= 128); a consumer whose 64 rows the previous K tile covers writes nothing.
    """
    bk = 64 * WGS
    c = lax.div(i, jnp.int32(n_tiles_k * n_tiles_n))
    r = lax.rem(i, jnp.int32(n_tiles_k * n_tiles_n))
    ki, ni = lax.div(r, jnp.int32(n_tiles_n)), lax.rem(r, jnp.int32(n_tiles_n))
    k0 = jnp.minimum(ki * bk, kdim - bk)
    mine = k0 + wg * 64
    return c, k0, ni, mine, mine >= ki * bk


def _keep_rows(a_smem, first, rows, interpret: bool):
    """Zero the rows of an SMEM tile outside [first, first + rows) (rows of other groups)."""
    ids = _iota(a_smem.shape, interpret)
    a_smem[...] = a_smem[...] * ((ids >= first) & (ids < first + rows)).astype(a_smem.dtype)
    plgpu.commit_smem()


def _drhs_kernel(table_ref, lo_ref, hi_ref, lhs_ref, dout_ref, out_ref, *, cfg, n_tiles_k: int, n_tiles_n: int):
    """d rhs[g][k0 + 64 w + [0, 64), n tile] for every group g of a chunk, in one pipeline.

    The pipeline walks the chunk's 64-row blocks; after a group's last block the consumer writes
    its accumulator out (TMA) and zeroes it. One pipeline per (chunk, K tile, N tile) keeps the
    TMA producer running across the chunk's groups (a group alone is only ~4 blocks).
    """
    bn, br = cfg.block_n, DRHS_ROWS
    bk = 64 * WGS  # K rows of a tile, 64 per consumer
    m, kdim = lhs_ref.shape
    tf = transforms(lhs_ref.dtype)
    pipeline = functools.partial(_drhs_pipeline, cfg=cfg, table_ref=table_ref, dtype=lhs_ref.dtype)
    ignore = lambda *_, **__: None
    # The real pipelines run a traced number of steps, so they keep all `drhs_stages` slots; a static
    # grid shorter than that would shrink the allocation below them (m = 100: a launch failure).
    steps = max(m // br, cfg.drhs_stages)
    allocs = pipeline(ignore, ignore, 0, steps).get_allocations(lhs_ref.at[:, pl.ds(0, bk)],
                                                                dout_ref.at[:, pl.ds(0, bn)])
    base = plgpu.SMEM((WGS, 64, bn), jnp.float32) if cfg.interpret else None

    @functools.partial(pl.run_scoped, allocs=allocs, o_smem=plgpu.SMEM((WGS, 64, bn), out_ref.dtype, transforms=tf),
                       t_scr=interpret_scratch(cfg, (64, br), lhs_ref.dtype), base=base, collective_axes="wg")
    def _scope(allocs, o_smem, t_scr, base):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((lo_ref.shape[0] * n_tiles_k * n_tiles_n,), collective_axes="sm")
        def _tile(info):
            c, k0, ni, mine, owner = _drhs_tile(info.index[0], wg, n_tiles_k, n_tiles_n, kdim)
            lo, hi = lo_ref[c], hi_ref[c]

            def body(idx, l_smem, d_smem, acc):
                e = lo + idx[0]
                grp, first, rows = table_ref[e, 0], table_ref[e, 2], table_ref[e, 3]
                a = l_smem.at[:, pl.ds(wg * 64, 64)]

                pl.when(owner & ((first > 0) | (rows < br)))(  # this consumer's half only
                    functools.partial(_keep_rows, a, first, rows, cfg.interpret))

                @pl.when(owner)
                def _():
                    mma(acc, a, d_smem, transpose_a=True, scratch=None if t_scr is None else t_scr.at[wg])
                    plgpu.wgmma_wait(0)

                @pl.when(owner & ((e + 1 == hi) | (table_ref[e + 1, 0] != grp)))
                def _():  # the group's last block: write d rhs[grp] tile, restart the sum
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous store
                    o_smem[wg] = _take_acc(acc, None if base is None else base.at[wg]).astype(o_smem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[grp, pl.ds(mine, 64), pl.ds(ni * bn, bn)])
                return acc

            def context(run):
                def with_acc(acc_ref):
                    if base is not None:  # the interpreter's stand-in for zeroing (see _take_acc)
                        base[wg] = jnp.zeros((64, bn), jnp.float32)
                    run(acc_ref)  # every group's sum is written inside the pipeline
                pl.run_scoped(with_acc, plgpu.ACC((64, bn), jnp.float32))

            pipeline(body, context, lo, hi - lo)(lhs_ref.at[:, pl.ds(k0, bk)], dout_ref.at[:, pl.ds(ni * bn, bn)],
                                                allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _take_acc(acc_ref, base_ref):
    """The accumulator's value, then zero it (on the GPU).

    The interpreter cannot store to an accumulator: there `base_ref` (fp32 SMEM) keeps the value
    at the last restart and the difference is returned.
    """
    value = acc_ref[...]
    if base_ref is None:
        acc_ref[...] = plgpu.layout_cast(jnp.zeros(value.shape, jnp.float32), plgpu.Layout.WGMMA)
        return value
    out = value - base_ref[...]
    base_ref[...] = value
    return out


def grouped_drhs(lhs, dout, group_sizes, g: int, cfg: GroupedMatmulConfig):
    """d rhs [G, K, N] = per group lhs_g^T @ dout_g (empty groups: zeros)."""
    m, k = lhs.shape
    n = dout.shape[1]
    m_pad = max(-(-m // 64) * 64, 64)
    k_pad = max(k, 64 * WGS)  # a K tile is 128 rows
    lhs = jnp.pad(lhs, ((0, m_pad - m), (0, k_pad - k))) if (m_pad, k_pad) != (m, k) else lhs
    dout = jnp.pad(dout, ((0, m_pad - m), (0, 0))) if m_pad != m else dout
    table, lo, hi = _drhs_table(group_sizes, m_pad, 64, cfg.drhs_groups)
    n_tiles_k, n_tiles_n = -(-k_pad // (64 * WGS)), n // cfg.block_n
    body = functools.partial(_drhs_kernel, cfg=cfg, n_tiles_k=n_tiles_k, n_tiles_n=n_tiles_n)
    out = kernel_call(body, cfg, out_type=jax.ShapeDtypeStruct((g, k_pad, n), lhs.dtype))(table, lo, hi, lhs, dout)
    return out if k_pad == k else out[:, :k]


# ----------------------------------------------------------------------------- public op


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs, rhs, group_sizes, cfg):
    return like(grouped_call(lhs, [rhs], group_sizes, cfg), lhs)


def _gmm_fwd(lhs, rhs, group_sizes, cfg):
    return _gmm(lhs, rhs, group_sizes, cfg), (lhs, rhs, group_sizes)


def _gmm_bwd(cfg, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    dlhs = grouped_call(dout, [rhs], group_sizes, dataclasses.replace(cfg, block_n=pick_block_n(lhs.shape[1])),
                        transpose_rhs=True)
    drhs = grouped_drhs(lhs, dout, group_sizes, rhs.shape[0], cfg)
    return like(dlhs, lhs), like(drhs, rhs), None  # inside shard_map: the primals' varying axes


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_matmul(lhs, rhs, group_sizes, *, config: GroupedMatmulConfig | None = None):
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` on Hopper tensor cores, with a custom VJP."""
    # inside shard_map: one varying set for all inputs (JAX transposes the casts of replicated ones)
    lhs, rhs, group_sizes = common(lhs, rhs, group_sizes.astype(jnp.int32))
    return _gmm(lhs, rhs, group_sizes, config or default_config(rhs.shape[2]))


def grouped_matmul_reference(lhs, rhs, group_sizes):
    """The semantics: jax.lax.ragged_dot with fp32 accumulation, output in lhs's dtype."""
    out = lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)
