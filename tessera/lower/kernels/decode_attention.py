"""Decode attention over a KV cache on Hopper (Mosaic GPU): few query tokens, long cache, split-K.

Semantics: reference/attention.py with per-batch `kv_len` and query positions `q_offset + s`
(default: the last Sq positions of the valid cache). A work item is one (batch, KV head, chunk):
the KV head's query heads x query tokens packed as rows (Sq * group <= 64, padded to 64 wgmma
rows) against one of `splits` chunks of the visible key blocks (causal end, window start and
kv_len read per batch at run time, so a window-128 layer reads ~128 keys, not the whole cache).
A memory warpgroup streams K/V tiles through a TMA ring; a compute warpgroup keeps fp32 running
max / sum (`_mgpu.online_softmax`, as the flash forward: the scaled exponent is one FMA). Only the
blocks at the edges of the visible range are masked (`MaskSpec.full_range`, with the batch's
kv_len and query position read at run time). Each item writes (normalised output,
log2-sum-exp2) per compute warpgroup; these partial results are merged outside the kernel, where
the sink joins the denominator (an empty part has lse -inf).

Persistent schedule (default): one CTA per SM; CTA c runs items c, c + grid, ... (items ordered
batch, chunk, head with the head fastest, so concurrent CTAs read neighbouring cache rows). Two
compute warpgroups share each item, taking its K/V steps alternately, so one's softmax overlaps
the other's products. The K/V ring runs on across items (a global step count), so the next item's
first tiles load during the current item's last steps and epilogue; the next item's Q and
query-position row are prefetched into a second slot; each item's output leaves through an SMEM
slot by TMA store, double-buffered where it fits so it overlaps the next item.
`persistent=False`: one CTA per item, grid (Hkv, splits, B), one compute warpgroup.

H200, B8 Hq64/Hkv8 D64 with sinks, GPU busy time against a 4224 GB/s copy (2026-11-25): 4k / 16k
/ 64k cache 21.2 / 65.6 / 243 us (75 / 97 / 104 %). One compute warpgroup: 22.2 / 70.2 / 261 us;
splits 4 instead of one wave of 128 items: 22.7 / 68.7 / 246 us. Before the unmasked interior
and the FMA exponent: 26.8 / 88.0 / 320 us.
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
from tessera.lower.kernels.attention_mask import MaskSpec, masked_stretches
from tessera.lower.reference.attention import attention as attention_reference

ROWS = 64  # wgmma rows: query heads of one KV head x query tokens, zero-padded in SMEM
_SMEM = 200 * 1024  # shared memory budget of a CTA (1 CTA per SM)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """block_kv keys per pipeline step, `stages` steps in flight, `splits` key chunks per head.

    `splits=None` picks one wave: as many chunks as fit B * Hkv * splits items on the SMs (at
    least 1, at most the cache's blocks). `persistent`: one CTA per SM (`num_ctas` overrides) walks
    the items with `compute_warpgroups` (1 or 2; 1 where two do not fit in SMEM); False: one CTA
    per item.
    """
    block_kv: int = 128
    stages: int = 4
    splits: int | None = None
    persistent: bool = True
    compute_warpgroups: int = 2
    num_ctas: int | None = None
    interpret: bool = False

    def __post_init__(self):
        if self.block_kv % 64:
            raise ValueError(f"{self.block_kv=} must be a multiple of 64")
        if self.stages < 2 or (self.splits is not None and self.splits < 1):
            raise ValueError(f"{self.stages=} must be >= 2 and {self.splits=} >= 1 (or None)")
        if self.compute_warpgroups not in (1, 2):
            raise ValueError(f"{self.compute_warpgroups=} must be 1 or 2")
        if self.num_ctas is not None and self.num_ctas < 1:
            raise ValueError(f"{self.num_ctas=} must be at least 1")


def supported(q, k, v, *, config=None) -> bool:
    """Hopper (or interpreter), fp16/bf16, head dim 64/128, Sq * (Hq / Hkv) <= 64."""
    cfg = config or DecodeConfig()
    if not (cfg.interpret or _mgpu.on_hopper()):
        return False
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[2] % k.shape[2]:
        return False
    if q.shape[-1] not in (64, 128) or k.shape[-1] != q.shape[-1]:
        return False
    if not (jnp.dtype(q.dtype) in _mgpu.HALF_DTYPES and q.dtype == k.dtype == v.dtype):
        return False
    return q.shape[1] * (q.shape[2] // k.shape[2]) <= ROWS


def _resolved(cfg: DecodeConfig, bsz: int, hkv: int, t: int, sq: int, window) -> DecodeConfig:
    """cfg with `splits` set: the given count, or one wave of items over the SMs (or `num_ctas`)."""
    if cfg.splits is not None:
        return cfg
    blocks = -(-t // cfg.block_kv)  # at most one chunk a block: more would be empty
    if window is not None:  # a window of w keys spans at most ceil((w + sq - 1) / bkv) + 1 blocks
        blocks = min(blocks, -(-(window + sq - 1) // cfg.block_kv) + 1)
    ctas = cfg.num_ctas or _mgpu.num_sms(cfg.interpret)
    return dataclasses.replace(cfg, splits=max(1, min(ctas // (bsz * hkv), blocks)))


def _batch_mask(b, kvlen_ref, qoff_ref, *, causal: bool, window) -> tuple[MaskSpec, jax.Array]:
    """(the mask of batch b, with its kv_len and first query position read at run time; that position)."""
    p_first = qoff_ref[b]
    return MaskSpec(causal=causal, window=window, q_offset=p_first, kv_len=kvlen_ref[b]), p_first


def _chunk_range(spec: MaskSpec, p_first, c, *, cfg: DecodeConfig, sq: int):
    """KV blocks [lo, hi) of chunk c: the visible blocks of the batch split into `splits` runs."""
    lo_all, hi_all = spec.key_range(p_first, p_first + sq - 1, cfg.block_kv)
    per = lax.div(hi_all - lo_all + (cfg.splits - 1), jnp.int32(cfg.splits))
    lo = jnp.minimum(lo_all + c * per, hi_all)
    return lo, jnp.minimum(lo + per, hi_all)


def _attend(q_smem, pos, spec: MaskSpec, p_first, lo, hi, g, rings, bars, *, cfg: DecodeConfig,
            sq: int, qk_scale: float, lane=0, lanes: int = 1):
    """Online softmax of the 64 packed rows over KV blocks [lo, hi): (acc [64, D], m, l), log2 units.

    Block kv sits in ring slot (g + kv - lo) % stages, g counting the steps consumed before; this
    warpgroup takes the blocks whose step (g + kv - lo) is `lane` mod `lanes`. Only blocks at the
    edges of the visible range (kv_len, causal end, window start) are masked.
    """
    k_ring, v_ring = rings
    k_full, v_full, k_free, v_free = bars
    bkv, stages, interp = cfg.block_kv, cfg.stages, cfg.interpret

    def step(t, carry, masked: bool):
        acc, m, l = carry
        kv = kv0 + t * lanes
        slot = lax.rem(g + kv - lo, stages)
        plgpu.barrier_wait(k_full.at[slot])
        s = _mgpu.mma(q_smem, k_ring.at[slot], (ROWS, bkv), transpose_b=True, interpret=interp)
        plgpu.barrier_arrive(k_free.at[slot])
        if masked:  # positions as fp32 tiles: the rows' come from an fp32 SMEM vector
            kpos = (_mgpu.iota2d((ROWS, bkv), 1, interpret=interp) + kv * bkv).astype(jnp.float32)
            s = jnp.where(spec.visible(lax.broadcast_in_dim(pos, s.shape, [0]), kpos), s, -jnp.inf)
        acc, m, l, p16 = _mgpu.online_softmax(s, acc, m, l, qk_scale=qk_scale, dtype=q_smem.dtype)
        plgpu.barrier_wait(v_full.at[slot])
        acc = _mgpu.mma(p16, v_ring.at[slot], acc.shape, acc=acc, interpret=interp)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m, l

    # this warpgroup's blocks: kv0 + t * lanes for t in [0, n); t_of(kv): the first t at or past kv
    kv0 = lo + (lax.rem(lane - lax.rem(g, lanes) + lanes, lanes) if lanes > 1 else 0)
    n = jnp.maximum(lax.div(hi - kv0 + (lanes - 1), jnp.int32(lanes)), 0)
    t_of = lambda kv: jnp.minimum(lax.div(jnp.maximum(kv - kv0, 0) + (lanes - 1), jnp.int32(lanes)), n)
    full_lo, full_hi = spec.full_range(p_first, p_first + sq - 1, bkv, lo, hi)
    carry = (_mgpu.zeros((ROWS, q_smem.shape[-1]), interpret=interp),
             _mgpu.row_vector(_mgpu.NEG_BIG, ROWS, interpret=interp),
             _mgpu.row_vector(0.0, ROWS, interpret=interp))
    return masked_stretches(step, carry, n - n, t_of(full_lo), t_of(full_hi), n)


def _zero_padding_rows(q_slots, rows: int, *, interpret: bool):
    """Zero the 64-row Q slots once when only `rows` (< 64) of them are loaded: the wgmma reads all
    64, and the rows past the queries stay zero. The zeros reach the tensor cores before any TMA."""
    if rows < ROWS:
        zero_tile = _mgpu.zeros(q_slots[0].shape, interpret=interpret).astype(q_slots[0].dtype)
        for slot in q_slots:
            slot[...] = zero_tile
        plgpu.commit_smem()


def _load_q(q_ref, pos_ref, b, h, q_slot, pos_slot, q_bar, pos_bar, rows: int):
    """TMA of batch b, KV head h's packed query rows and their positions into their slots."""
    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_slot.at[pl.ds(0, rows)], q_bar)
    plgpu.copy_gmem_to_smem(pos_ref.at[b], pos_slot, pos_bar)


def _store_part(acc, m, l, o_slot, lse_slot, o_dst, lse_dst, rows: int):
    """Write one partial result, (acc / l [64, D], log2-sum-exp2 [64]; an empty chunk gives
    (0, -inf)), through its SMEM slots to o_dst / lse_dst: only the rows that hold queries leave
    (8 of 64 for one token of 8 grouped heads)."""
    inv_l = 1.0 / jnp.where(l == 0.0, 1.0, l)
    o_slot[...] = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
    lse_slot[...] = m + jnp.log2(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_slot.at[pl.ds(0, rows)], o_dst)
    plgpu.copy_smem_to_gmem(lse_slot.at[pl.ds(0, rows)], lse_dst)


def _kernel(q_ref, k_ref, v_ref, pos_ref, qoff_ref, kvlen_ref, o_ref, lse_ref, smem, bars, *,
            cfg: DecodeConfig, causal: bool, window, sq: int, qk_scale: float):
    """One (kv head, chunk, batch): partial attention of the packed rows over the chunk's keys."""
    q_smem, k_ring, v_ring, row_smem, o_smem = smem
    q_bar, row_bar, k_full, v_full, k_free, v_free = bars
    bkv, stages, interp = cfg.block_kv, cfg.stages, cfg.interpret
    h, c, b, wg = lax.axis_index("h"), lax.axis_index("c"), lax.axis_index("b"), lax.axis_index("wg")
    spec, p_first = _batch_mask(b, kvlen_ref, qoff_ref, causal=causal, window=window)
    lo, hi = _chunk_range(spec, p_first, c, cfg=cfg, sq=sq)

    @pl.when(wg == 0)
    def _compute():
        rows = q_ref.shape[2]  # Sq * group rounded up to 8
        _zero_padding_rows([q_smem], rows, interpret=interp)
        _load_q(q_ref, pos_ref, b, h, q_smem, row_smem, q_bar.at[0], row_bar.at[0], rows)
        plgpu.barrier_wait(q_bar.at[0])
        plgpu.barrier_wait(row_bar.at[0])
        pos = _mgpu.load_rows(row_smem, interpret=interp)  # [ROWS] query positions (-1: padding)
        acc, m, l = _attend(q_smem, pos, spec, p_first, lo, hi, lo - lo, (k_ring, v_ring),
                            (k_full, v_full, k_free, v_free), cfg=cfg, sq=sq, qk_scale=qk_scale)
        _store_part(acc, m, l, o_smem, row_smem, o_ref.at[b, h, c], lse_ref.at[b, h, c], rows)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        tile = lambda ref: (lambda kv: ref.at[b, pl.ds(kv * bkv, bkv), h])
        _mgpu.stream(lo, hi, stages, [(tile(k_ref), k_ring, k_full, k_free),
                                      (tile(v_ref), v_ring, v_full, v_free)])


@dataclasses.dataclass(frozen=True)
class _Work:
    """The persistent schedule: item w = ((b * splits + c) * hkv + h); CTA `cta` runs cta, cta + grid, ..."""
    bsz: int
    hkv: int
    splits: int
    grid: int

    def count(self, cta):
        """Items CTA `cta` runs."""
        return _mgpu.strided_count(self.bsz * self.hkv * self.splits, cta, self.grid)

    def item(self, cta, i):
        """(batch, kv head, chunk) of the CTA's i-th item."""
        w = cta + i * self.grid
        h = lax.rem(w, jnp.int32(self.hkv))
        bc = lax.div(w, jnp.int32(self.hkv))
        return lax.div(bc, jnp.int32(self.splits)), h, lax.rem(bc, jnp.int32(self.splits))


def _persistent_kernel(q_ref, k_ref, v_ref, pos_ref, qoff_ref, kvlen_ref, o_ref, lse_ref, smem,
                       bars, *, cfg: DecodeConfig, work: _Work, causal: bool, window, sq: int,
                       qk_scale: float):
    """Persistent CTA: compute warpgroups 0..W-1 share each item's blocks (step g goes to warpgroup
    g % W) and write one partial result each; warpgroup W streams the K/V tiles.

    Each compute warpgroup has its own Q / position slots, alternating by item parity, and output
    slots, alternating by item % n_out (1 or 2).
    """
    # [W, 2, 64, D], [stages, bkv, D] x2, [W, 2, 64], [W, n_out, 64, D] fp32, [W, n_out, 64] fp32
    q_smem, k_ring, v_ring, pos_smem, o_smem, lse_smem = smem
    q_bar, pos_bar, k_full, v_full, k_free, v_free = bars  # q_bar, pos_bar: [W * 2]
    bkv, stages, interp = cfg.block_kv, cfg.stages, cfg.interpret
    lanes, n_out = cfg.compute_warpgroups, o_smem.shape[1]
    cta, wg = lax.axis_index("c"), lax.axis_index("wg")
    n_items = work.count(cta)
    zero = n_items - n_items
    batch_mask = functools.partial(_batch_mask, kvlen_ref=kvlen_ref, qoff_ref=qoff_ref, causal=causal,
                                   window=window)

    @pl.when(wg < lanes)
    def _compute():
        lane = wg
        q_own, pos_own, o_own, lse_own = (x.at[lane] for x in (q_smem, pos_smem, o_smem, lse_smem))
        rows = q_ref.shape[2]  # Sq * group rounded up to 8
        _zero_padding_rows([q_own.at[buf] for buf in range(2)], rows, interpret=interp)

        def load_q(i, buf):
            b, h, _ = work.item(cta, i)
            _load_q(q_ref, pos_ref, b, h, q_own.at[buf], pos_own.at[buf], q_bar.at[2 * lane + buf],
                    pos_bar.at[2 * lane + buf], rows)

        pl.when(n_items > 0)(lambda: load_q(zero, 0))

        def item_body(i, g):  # g: K/V steps consumed before item i
            buf = lax.rem(i, 2)
            # slot 1 - buf held item i-1's Q, whose products have completed: prefetch item i+1
            pl.when(i + 1 < n_items)(lambda: load_q(i + 1, 1 - buf))
            b, h, c = work.item(cta, i)
            spec, p_first = batch_mask(b)
            lo, hi = _chunk_range(spec, p_first, c, cfg=cfg, sq=sq)
            plgpu.barrier_wait(q_bar.at[2 * lane + buf])
            plgpu.barrier_wait(pos_bar.at[2 * lane + buf])
            pos = _mgpu.load_rows(pos_own.at[buf], interpret=interp)  # query positions (-1: padding)
            acc, m, l = _attend(q_own.at[buf], pos, spec, p_first, lo, hi, g, (k_ring, v_ring),
                                (k_full, v_full, k_free, v_free), cfg=cfg, sq=sq,
                                qk_scale=qk_scale, lane=lane, lanes=lanes)
            out = lax.rem(i, n_out)
            # the output slot's last store (item i - n_out) must have been read out (2 copies an item)
            plgpu.wait_smem_to_gmem(2 * (n_out - 1), wait_read_only=True)
            part = c * lanes + lane
            _store_part(acc, m, l, o_own.at[out], lse_own.at[out], o_ref.at[b, h, part],
                        lse_ref.at[b, h, part], rows)
            return g + (hi - lo)

        lax.fori_loop(zero, n_items, item_body, zero)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == lanes)
    def _memory():
        def item(i):
            b, h, c = work.item(cta, i)
            lo, hi = _chunk_range(*batch_mask(b), c, cfg=cfg, sq=sq)
            return lo, hi, lambda kv: (b, pl.ds(kv * bkv, bkv), h)
        _mgpu.stream_items(n_items, item, stages, [(k_ref, k_ring, k_full, k_free), (v_ref, v_ring, v_full, v_free)])


def _merge(o, lse, sinks, group: int, sq: int):
    """Combine chunks: o [B, Hkv, C, R, D] fp32, lse [B, Hkv, C, R] (log2; R >= Sq * group) -> [B, Sq, Hq, D]."""
    bsz, hkv, _, _, d = o.shape
    rows = sq * group
    o, lse = o[:, :, :, :rows], lse[:, :, :, :rows]
    m = jnp.max(lse, axis=2, keepdims=True)  # [B, Hkv, 1, rows]
    sink = None
    if sinks is not None:  # row r = s * group + g reads query head h * group + g
        sink = (sinks.astype(jnp.float32) * _mgpu.LOG2E).reshape(1, hkv, 1, 1, group)
        sink = jnp.broadcast_to(sink, (1, hkv, 1, sq, group)).reshape(1, hkv, 1, rows)
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # every chunk empty (and no sink): the output is 0
    w = jnp.exp2(lse - m)  # [B, Hkv, C, rows]; an empty chunk (lse -inf) weighs 0
    denom = jnp.sum(w, axis=2) + (0.0 if sink is None else jnp.exp2(sink - m)[:, :, 0])
    out = jnp.sum(w[..., None] * o, axis=2) / jnp.where(denom == 0, 1.0, denom)[..., None]  # [B, Hkv, rows, D]
    out = out.reshape(bsz, hkv, sq, group, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(bsz, sq, hkv * group, d)


def _fit_stages(cfg: DecodeConfig, d: int, dtype, fixed: int) -> DecodeConfig:
    """`stages` cut to what fits in ~200 KiB of SMEM next to `fixed` bytes (at least 2)."""
    per_stage = 2 * cfg.block_kv * d * jnp.dtype(dtype).itemsize
    return dataclasses.replace(cfg, stages=max(2, min(cfg.stages, (_SMEM - fixed) // per_stage)))


def _call_grid(cfg: DecodeConfig, out_type, dtype, kw):
    """One CTA per (kv head, chunk, batch): grid (Hkv, splits, B)."""
    bsz, hkv, _, _, d = out_type[0].shape
    cfg = _fit_stages(cfg, d, dtype, ROWS * d * (jnp.dtype(dtype).itemsize + 4))
    tf = _mgpu.smem_transforms(dtype)
    ring = plgpu.SMEM((cfg.stages, cfg.block_kv, d), dtype, transforms=tf)
    smem = (plgpu.SMEM((ROWS, d), dtype, transforms=tf), ring, ring,
            plgpu.SMEM((ROWS,), jnp.float32), plgpu.SMEM((ROWS, d), jnp.float32))
    bars = (plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=1),
            *(plgpu.Barrier(num_barriers=cfg.stages) for _ in range(4)))
    return _mgpu.kernel_call(
        functools.partial(_kernel, cfg=cfg, **kw), interpret=cfg.interpret, out_type=out_type,
        grid=(hkv, cfg.splits, bsz), grid_names=("h", "c", "b"), num_threads=2, thread_name="wg",
        scratch_types=(smem, bars))


def _persistent_plan(cfg: DecodeConfig, d: int, dtype) -> tuple[DecodeConfig, int]:
    """(cfg with the compute warpgroups and ring depth that fit in SMEM, output slots per warpgroup).

    Each compute warpgroup holds two Q + position slots and one or two fp32 output slots: two where
    they fit beside a 2-deep ring (head dim 64). A second compute warpgroup is dropped where even
    one output slot each leaves no room for a 2-deep ring (head dim 128 with 128-key tiles).
    """
    size = jnp.dtype(dtype).itemsize
    q_bytes, o_bytes = ROWS * (d * size + 4), ROWS * (d + 1) * 4  # a Q + position slot, an output slot
    ring2 = 4 * cfg.block_kv * d * size
    fixed = lambda lanes, n_out: lanes * (2 * q_bytes + n_out * o_bytes)
    lanes = cfg.compute_warpgroups
    while lanes > 1 and fixed(lanes, 1) + ring2 > _SMEM:
        lanes -= 1
    n_out = 2 if fixed(lanes, 2) + ring2 <= _SMEM else 1
    cfg = _fit_stages(dataclasses.replace(cfg, compute_warpgroups=lanes), d, dtype, fixed(lanes, n_out))
    # a ring slot must always serve the same warpgroup: each warpgroup tracks the phases of the
    # barriers it waits on, so it has to see every phase of them
    return dataclasses.replace(cfg, stages=cfg.stages - cfg.stages % lanes), n_out


def _call_persistent(cfg: DecodeConfig, out_type, dtype, kw, *, n_out: int):
    """min(items, SMs) CTAs walking the (batch, chunk, head) items; see `_persistent_kernel`.
    cfg and n_out (output slots per compute warpgroup) as `_persistent_plan` gave them."""
    bsz, hkv, _, _, d = out_type[0].shape
    lanes = cfg.compute_warpgroups
    n_items = bsz * hkv * cfg.splits
    grid = min(n_items, cfg.num_ctas or _mgpu.num_sms(cfg.interpret))
    tf = _mgpu.smem_transforms(dtype)
    ring = plgpu.SMEM((cfg.stages, cfg.block_kv, d), dtype, transforms=tf)
    smem = (plgpu.SMEM((lanes, 2, ROWS, d), dtype, transforms=tf), ring, ring,
            plgpu.SMEM((lanes, 2, ROWS), jnp.float32), plgpu.SMEM((lanes, n_out, ROWS, d), jnp.float32),
            plgpu.SMEM((lanes, n_out, ROWS), jnp.float32))
    bars = (plgpu.Barrier(num_barriers=2 * lanes), plgpu.Barrier(num_barriers=2 * lanes),
            *(plgpu.Barrier(num_barriers=cfg.stages) for _ in range(4)))
    body = functools.partial(_persistent_kernel, cfg=cfg, work=_Work(bsz, hkv, cfg.splits, grid), **kw)
    return _mgpu.kernel_call(
        body, interpret=cfg.interpret, out_type=out_type, grid=(grid,), grid_names=("c",),
        num_threads=lanes + 1, thread_name="wg", scratch_types=(smem, bars))


def decode_attention(q, k, v, *, kv_len=None, q_offset=None, sinks=None, causal: bool = True,
                     window: int | None = None, scale: float | None = None,
                     config: DecodeConfig | None = None):
    """Attention of q [B, Sq, Hq, D] against a cache k/v [B, T, Hkv, D] (forward only).

    kv_len [B] (default T) counts valid cache entries; q_offset [B] (default kv_len - Sq) is the
    position of the first query token.
    """
    bsz, sq, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    cfg = _resolved(config or DecodeConfig(), bsz, hkv, t, sq, window)
    group = hq // hkv
    scale = d ** -0.5 if scale is None else float(scale)
    kv_len = jnp.broadcast_to(jnp.asarray(t if kv_len is None else kv_len, jnp.int32), (bsz,))
    q_off = kv_len - sq if q_offset is None else jnp.asarray(q_offset, jnp.int32)
    q_off = jnp.broadcast_to(q_off, (bsz,)).astype(jnp.int32)
    t_pad = -(-t // cfg.block_kv) * cfg.block_kv
    if t_pad != t:
        k, v = (jnp.pad(x, ((0, 0), (0, t_pad - t), (0, 0), (0, 0))) for x in (k, v))
    # rows r = s * group + g of kv head h hold query (s, h * group + g); [B, Hkv, ROWS, D]
    qp = q.reshape(bsz, sq, hkv, group, d).transpose(0, 2, 1, 3, 4).reshape(bsz, hkv, sq * group, d)
    rows_in = -(-sq * group // 8) * 8  # TMA fills whole (8, 64) tiles of the 64-row wgmma tile
    if rows_in != sq * group:
        qp = jnp.pad(qp, ((0, 0), (0, 0), (0, rows_in - sq * group), (0, 0)))
    r = jnp.arange(ROWS)
    pos = jnp.where(r < sq * group, q_off[:, None] + r // group, -1).astype(jnp.float32)  # [B, ROWS]
    if cfg.persistent:
        cfg, n_out = _persistent_plan(cfg, d, q.dtype)
        lanes, call = cfg.compute_warpgroups, functools.partial(_call_persistent, n_out=n_out)
    else:
        lanes, call = 1, _call_grid
    parts = cfg.splits * lanes  # partial results per head
    out_type = (jax.ShapeDtypeStruct((bsz, hkv, parts, rows_in, d), jnp.float32),
                jax.ShapeDtypeStruct((bsz, hkv, parts, rows_in), jnp.float32))
    kw = dict(causal=causal, window=window, sq=sq, qk_scale=scale * _mgpu.LOG2E)
    o, lse = call(cfg, out_type, q.dtype, kw)(qp, k, v, pos, q_off, kv_len)
    return _merge(o, lse, sinks, group, sq).astype(q.dtype)


def decode_attention_reference(q, k, v, *, kv_len=None, q_offset=None, sinks=None, causal=True,
                               window=None, scale=None):
    """reference/attention.py with the decode defaults (q at the last Sq valid positions)."""
    t, sq = k.shape[1], q.shape[1]
    kv_len = jnp.broadcast_to(jnp.asarray(t if kv_len is None else kv_len, jnp.int32), (q.shape[0],))
    q_offset = kv_len - sq if q_offset is None else q_offset
    return attention_reference(q, k, v, sinks=sinks, causal=causal, window=window, scale=scale,
                               q_offset=q_offset, kv_len=kv_len)
