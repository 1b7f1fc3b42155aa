"""Forward kernel of `flash_attention` (Mosaic GPU, Hopper), FlashAttention-3 style.

A work item is 2 x `block_q` query rows of one query head; a persistent CTA (one per SM) runs items
heaviest-first (dealt in a snake, see `_Work`) with 2 compute warpgroups (one `block_q` half each)
and 1 memory warpgroup that loads the items' Q ahead and streams K/V tiles through a `stages`-deep
TMA ring kept running across items. The compute warpgroups ping-pong on a schedule barrier so one's
softmax overlaps the other's wgmma. Only KV blocks holding a visible key are visited (window:
O(window) per row, not O(T)); blocks where every key is visible skip the mask, and an edge block
whose visible keys all lie in one half runs at half width. Sinks seed the running max/denominator.
Statistics are kept in the log2 domain (exp2 with the scale folded in), fp32; the output of a fully
masked row is 0, as in the reference; the log-sum-exp the backward needs is stored only when a
gradient is taken. The phases of a step and an item are named scopes, which `_mgpu.profiling` (and
`python -m bench.profile`) turns into an on-device trace of each warpgroup.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tessera.lower.kernels import _mgpu
from tessera.lower.kernels._vma import like
from tessera.lower.kernels.attention_mask import MaskSpec, masked_stretches

if TYPE_CHECKING:
    from tessera.lower.kernels.flash_attention import FlashConfig


_WGS = 2  # compute warpgroups per CTA (3 measured slower on an H200 at head dim 64: 265 vs 359 TFLOP/s)


@dataclasses.dataclass(frozen=True)
class _Work:
    """The persistent schedule: items (tile, batch, head), heaviest (latest causal) tiles first.

    Round r hands items r * grid ... (r + 1) * grid - 1 out to the CTAs, in CTA order on even
    rounds and in reverse on odd ones (a snake). Item weights only fall, so each pair of rounds
    evens out: on B4 S4096 H64 causal every CTA gets 1024 KV blocks, where dealing every round
    in CTA order gave CTA 0 1040 and the last one 1008 (the kernel ends with its slowest CTA).
    """
    n_tiles: int
    bsz: int
    hq: int
    grid: int
    rows: int
    block_kv: int
    mask: MaskSpec

    def _place(self, cta, rnd):
        """CTA `cta`'s place in round `rnd`: in CTA order on even rounds, reversed on odd ones."""
        return jnp.where(lax.rem(rnd, 2) == 0, cta, self.grid - 1 - cta)

    def count(self, cta):
        """Items CTA `cta` runs: one a round, and one of the last, partial round if it reaches it."""
        return self._count_below(cta, self.n_tiles * self.bsz * self.hq)

    def _count_below(self, cta, end: int):
        """How many of CTA `cta`'s items are among items 0 .. end-1 of the deal (a prefix of its list:
        the CTA's item i is item i * grid + place, which grows with i)."""
        rounds, rest = divmod(max(end, 0), self.grid)
        return jnp.int32(rounds) + (self._place(cta, jnp.int32(rounds)) < rest).astype(jnp.int32)

    def item(self, cta, i):
        """(batch, head, first row, first/last KV block) of the CTA's i-th item."""
        b, h, tile, lo, hi = self.locate(cta, i)
        return b, h, tile * self.rows, lo, hi

    def locate(self, cta, i):
        """(batch, head, row tile, first/last KV block) of the CTA's i-th item."""
        w = i * self.grid + self._place(cta, i)
        per_tile = self.bsz * self.hq
        tile = self.n_tiles - 1 - lax.div(w, jnp.int32(per_tile))
        rest = lax.rem(w, jnp.int32(per_tile))
        b, h = lax.div(rest, jnp.int32(self.hq)), lax.rem(rest, jnp.int32(self.hq))
        p = tile * self.rows + self.mask.q_offset
        lo, hi = self.mask.key_range(p, p + self.rows - 1, self.block_kv)
        return b, h, tile, lo, hi


def _forward_kernel(q_ref, k_ref, v_ref, sink_ref, out_ref, *rest, cfg: FlashConfig, work: _Work,
                    has_sinks: bool, group: int, qk_scale: float):
    """Persistent CTA: warpgroups 0 and 1 compute 64-row halves of each item, warpgroup 2 loads.

    The memory warpgroup loads each item's Q (and sink row) into a slot of a 2- or 3-slot buffer
    and streams its K/V tiles through a ring; each item's output leaves through the slot that held
    its Q, and a compute warpgroup hands the slot back (`q_free`) once that output has been read
    out. The ring and its barriers run on across items, so the producer fills the next item's
    pipeline during an epilogue. Loading Q in the producer, not in the compute warpgroups, took
    the causal forward from 1011-1041 to 891-912 us at D128 and from 1265-1277 to 1243-1248 us at
    D64 (H200, both builds timed in turns; docs/kernels-log.md, "Attention forward").
    """
    *lse_refs, smem, bars = rest  # [lse_ref], or [] without a gradient
    q_smem, k_smem, v_smem, row_smem = smem  # [n_buf, 2, bq, d], [stages, bkv, d] x2, [n_buf, 2, bq]
    # q_bar: an item's Q and sink row both; q_free: a warpgroup's half of a slot is free again
    q_bar, k_bar, v_bar, k_free, v_free, sched, q_free = bars
    n, bq, bkv, stages = _WGS, cfg.block_q, cfg.block_kv, cfg.stages
    n_buf = q_smem.shape[0]
    mask = work.mask
    dtype = q_smem.dtype
    cta, wg = lax.axis_index("c"), lax.axis_index("wg")
    n_items = work.count(cta)
    copies = 1 + len(lse_refs)  # TMA stores an item issues

    def sched_sync():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    @pl.when(wg < n)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        pl.when(wg == 1)(sched_sync)  # warpgroup 1 starts one schedule phase late: the ping-pong

        # g: K/V steps this CTA consumed before item i; `item`: where item i is (`_Work.locate`),
        # worked out during item i-1's epilogue, where its chain of integer divisions overlaps the
        # output's scaling instead of delaying the item's first Q K^T (H200, window 128 + sinks, ten
        # rounds in turns: D128 172 against 184 us, D64 191 against 191 us)
        def release(i):  # slot (i+1) % n_buf, for item i+1's Q, once item i+1-n_buf's output left it
            @pl.when((i + 1 < n_items) & (i + 1 >= n_buf))
            def _():
                plgpu.wait_smem_to_gmem(copies * (n_buf - 2), wait_read_only=True)
                plgpu.barrier_arrive(q_free.at[lax.rem(i + 1, n_buf) * n + wg])

        def epilogue(i, item, acc, m, l):  # item i's output (and statistics) out through its Q slot
            b, h, tile, _, _ = item
            row, buf = tile * work.rows, lax.rem(i, n_buf)
            inv_l = 1.0 / jnp.where(l == 0.0, 1.0, l)  # fully masked rows: acc == 0, out == 0
            q_smem.at[buf, wg][...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(dtype)
            if lse_refs:  # log2-sum-exp2 (sink included); -inf if empty
                row_smem.at[buf, wg][...] = m + jnp.log2(l)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[buf, wg], out_ref.at[b, pl.ds(row + wg * bq, bq), h])
            for ref in lse_refs:
                plgpu.copy_smem_to_gmem(row_smem.at[buf, wg], ref.at[b, h, pl.ds(row + wg * bq, bq)])

        def place_of(i):  # `_Work.locate` of item i, the last item's past the end
            return work.locate(cta, jnp.minimum(i, n_items - 1))

        def item_body(i, carry):
            g, item = carry
            buf = lax.rem(i, n_buf)
            b, h, tile, lo, hi = item  # (a carried row, not tile, trips jax 0.11's layout inference)
            row = tile * work.rows
            if n_buf == 3:  # item i-2's output left long ago: no wait
                with jax.named_scope("release_q"):
                    release(i)
            else:  # item i-1's output has just been issued: release in the first step
                pl.when(hi == lo)(functools.partial(release, i))
            args = (q_smem.at[buf, wg], row_smem.at[buf, wg], q_bar.at[buf * n + wg],
                    row + wg * bq + mask.q_offset, lo, hi, g,
                    k_smem, v_smem, (k_bar, v_bar, k_free, v_free, sched))
            acc, m, l = _attend(*args, cfg=cfg, mask=mask, has_sinks=has_sinks, qk_scale=qk_scale,
                                first_step=functools.partial(release, i) if n_buf == 2 else None)
            with jax.named_scope("epilogue"):
                nxt = place_of(i + 1)
                epilogue(i, item, acc, m, l)
            return g + (hi - lo), nxt

        zero = n_items - n_items
        lax.fori_loop(zero, n_items, item_body, (zero, work.locate(cta, zero)))
        pl.when(wg == 0)(sched_sync)  # balance the offset so every schedule phase completes
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == n)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def item(i):  # loads item i's Q and sink rows (each half once its warpgroup released the slot)
            b, h, row, lo, hi = work.item(cta, i)
            buf = lax.rem(i, n_buf)
            for w in range(n):
                pl.when(i >= n_buf)(functools.partial(plgpu.barrier_wait, q_free.at[buf * n + w]))
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row + w * bq, bq), h], q_smem.at[buf, w],
                                        q_bar.at[buf * n + w])
                plgpu.copy_gmem_to_smem(sink_ref.at[h], row_smem.at[buf, w], q_bar.at[buf * n + w])
            kv_head = lax.div(h, jnp.int32(group))
            return lo, hi, lambda kv: (b, pl.ds(kv * bkv, bkv), kv_head)
        _mgpu.stream_items(n_items, item, stages, [(k_ref, k_smem, k_bar, k_free), (v_ref, v_smem, v_bar, v_free)])


def _attend(q_smem, row_smem, q_bar, p0, lo, hi, g, k_smem, v_smem, bars, *,
            cfg: FlashConfig, mask: MaskSpec, has_sinks: bool, qk_scale: float, first_step):
    """One warpgroup's online softmax over KV blocks [lo, hi): (acc [bq, d], m, l) in log2 units.

    `first_step()`, if given, runs in the first step before it waits for its turn on the tensor
    cores. That turn may wait for the other warpgroup's next Q K^T, whose K the producer may load
    only after the next item's Q: a slot release the producer waits for must come before it.
    """
    k_bar, v_bar, k_free, v_free, sched = bars
    bq, bkv, stages, interp = cfg.block_q, cfg.block_kv, cfg.stages, cfg.interpret
    dtype = q_smem.dtype
    carry = _start(q_smem, row_smem, q_bar, has_sinks=has_sinks, interpret=interp)

    def sync_after_issue():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    with jax.named_scope("wait_k"):
        pl.when(hi > lo)(lambda: plgpu.barrier_wait(k_bar.at[lax.rem(g, stages)]))

    def step(kv, carry, masked, part=None):
        """Block kv; `part` 0 / 1: only its first / second half of keys (the other holds none visible)."""
        acc, m, l = carry
        slot = lax.rem(g + kv - lo, stages)
        n = bkv if part is None else bkv // 2
        first_key = 0 if part is None else part * n
        k_tile, v_tile = (ring.at[slot] if part is None else ring.at[slot, pl.ds(first_key, n)]
                          for ring in (k_smem, v_smem))
        # the schedule barrier lets the other warpgroup's softmax start while this wgmma runs
        with jax.named_scope("qk"):
            s = _mgpu.mma(q_smem, k_tile, (bq, n), transpose_b=True, interpret=interp,
                          then=sync_after_issue)
        plgpu.barrier_arrive(k_free.at[slot])
        with jax.named_scope("softmax" if part is None else "softmax_half"):
            if masked:
                s = jnp.where(mask.tile(p0, kv * bkv + first_key, (bq, n), interpret=interp), s, -jnp.inf)
            acc, m_new, l, p16 = _mgpu.online_softmax(s, acc, m, l, qk_scale=qk_scale, dtype=dtype)
        # ptxas hoists this arrive to just after the Q K^T wait, so the other warpgroup's
        # softmax may start alongside this one; pinned after the V wait instead, the causal
        # forward took 1377 against 1205 us (H200, D64; docs/kernels-log.md)
        plgpu.barrier_arrive(sched)  # softmax done
        with jax.named_scope("wait_v"):
            plgpu.barrier_wait(v_bar.at[slot])
        if first_step is not None:
            pl.when(kv == lo)(first_step)
        with jax.named_scope("wait_turn"):
            plgpu.barrier_wait(sched)  # tensor cores free again

        def wait_next_k():
            nxt = kv + 1
            pl.when(nxt < hi)(lambda: plgpu.barrier_wait(k_bar.at[lax.rem(g + nxt - lo, stages)]))
        with jax.named_scope("pv"):
            acc = _mgpu.mma(p16, v_tile, acc.shape, acc=acc, interpret=interp, then=wait_next_k)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

    # Edge blocks whose visible keys all lie in one half run at half width: on the causal
    # diagonal the upper 64-row warpgroup sees only the first half of its last block, and with a
    # 128 window the lower one only the second half of its first block. Only 128-key tiles take
    # halves: theirs are the ones GPU-tested. The 32-key halves of 64-key tiles failed the GPU
    # test although the interpreter passed them, and the halves of 192- or 256-key tiles (no
    # default where there is a mask) have not run on a GPU.
    full_lo, full_hi = mask.full_range(p0, p0 + bq - 1, bkv, lo, hi)
    up, down = (mask.half_edges(p0, p0 + bq - 1, bkv, lo, full_lo, full_hi, hi) if bkv == 128
                else (None, None))
    if up is not None:
        carry = lax.fori_loop(lo, lo + up, functools.partial(step, masked=True, part=1), carry)
    rest_lo = lo if up is None else lo + up
    rest_hi = hi if down is None else hi - down
    if mask.may_have_full_blocks(bq, bkv):
        carry = masked_stretches(step, carry, rest_lo, full_lo, full_hi, rest_hi)
    else:  # one loop, not three of which two would run no trips (window 128 + sinks, D64, H200:
        # 210-211 against 213-216 us, with the Q and sink row on one barrier)
        carry = lax.fori_loop(rest_lo, rest_hi, functools.partial(step, masked=True), carry)
    if down is not None:
        carry = lax.fori_loop(rest_hi, hi, functools.partial(step, masked=True, part=0), carry)
    return carry


def _start(q_smem, row_smem, q_bar, *, has_sinks: bool, interpret: bool):
    """Wait for the item's Q and sink row; the running (acc, m, l) before its first block: zeros
    and the sink's seed (`_seed`)."""
    with jax.named_scope("wait_q"):
        plgpu.barrier_wait(q_bar)
    return (_mgpu.zeros(q_smem.shape, interpret=interpret),
            *_seed(row_smem, has_sinks=has_sinks, interpret=interpret))


def _seed(row_smem, *, has_sinks: bool, interpret: bool):
    """The running (m, l) before an item's first key: the sink's logit in log2 units (NEG_BIG
    without sinks), read from the item's loaded sink row, and the sink's weight 1 (or 0)."""
    return (_mgpu.load_rows(row_smem, interpret=interpret),
            _mgpu.row_vector(1.0 if has_sinks else 0.0, row_smem.shape[0], interpret=interpret))


# ----------------------------------------------------------------------------- forward driver


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_seq(x, n: int, front: int = 0):
    """Zero-pad axis 1 of [B, S, H, D] to length n, `front` of the new rows before the first."""
    back = n - x.shape[1] - front
    return x if x.shape[1] == n else jnp.pad(x, ((0, 0), (front, back), (0, 0), (0, 0)))


def _q_slots(cfg: FlashConfig, d: int, dtype) -> int:
    """3 Q/output slots where they fit beside the K/V ring in ~200 KiB of SMEM (head dim 64), else 2."""
    size = jnp.dtype(dtype).itemsize
    ring = 2 * cfg.stages * cfg.block_kv * d * size
    return 3 if 3 * _WGS * cfg.block_q * (d * size + 4) + ring <= 200 * 1024 else 2


def _schedule(bsz: int, s: int, hq: int, t: int, d: int, *, causal, window, q_offset,
              cfg: FlashConfig) -> tuple[_Work, int]:
    """(the persistent schedule of a forward call over q [B, S, Hq, D] and T keys, the number of
    padding query rows in front of the first)."""
    rows = _WGS * cfg.block_q
    s_pad, t_pad = _round_up(s, rows), _round_up(t, cfg.block_kv)
    # Causal: the query padding goes in front, where its rows see no keys and their blocks are
    # skipped or cheap; at the end each padded row would see every key.
    front = s_pad - s if causal else 0
    mask = MaskSpec(causal=causal, window=window, q_offset=q_offset - front, kv_len=t,
                    keys_padded=t_pad > t, diff_tile=d <= 64)  # see MaskSpec.diff_tile
    n_items = (s_pad // rows) * bsz * hq
    grid = min(n_items, cfg.num_ctas or _mgpu.num_sms(cfg.interpret))
    return _Work(s_pad // rows, bsz, hq, grid, rows, cfg.block_kv, mask), front


def _forward(q, k, v, sinks, *, causal, window, scale, q_offset, cfg: FlashConfig, has_sinks: bool,
             want_lse: bool = True):
    """(out [B, S, Hq, D], lse [B, Hq, S] log2 units, or None unless `want_lse`) of the forward kernel."""
    bsz, s, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    work, front = _schedule(bsz, s, hq, t, d, causal=causal, window=window, q_offset=q_offset, cfg=cfg)
    n, grid = _WGS, work.grid
    s_pad, t_pad = work.n_tiles * work.rows, _round_up(t, cfg.block_kv)
    qp, kp, vp = _pad_seq(q, s_pad, front), _pad_seq(k, t_pad), _pad_seq(v, t_pad)
    sink_rows = sinks.astype(jnp.float32) * _mgpu.LOG2E if has_sinks else jnp.full((hq,), _mgpu.NEG_BIG)
    sink_rows = jnp.broadcast_to(sink_rows[:, None], (hq, cfg.block_q)).astype(jnp.float32)
    stages = min(cfg.stages, max(t_pad // cfg.block_kv, 2))
    cfg = dataclasses.replace(cfg, stages=stages)
    tf = _mgpu.smem_transforms(q.dtype)
    n_buf = _q_slots(cfg, d, q.dtype)
    smem = (plgpu.SMEM((n_buf, n, cfg.block_q, d), q.dtype, transforms=tf),
            plgpu.SMEM((stages, cfg.block_kv, d), q.dtype, transforms=tf),
            plgpu.SMEM((stages, cfg.block_kv, d), q.dtype, transforms=tf),
            plgpu.SMEM((n_buf, n, cfg.block_q), jnp.float32))
    bars = (plgpu.Barrier(num_arrivals=2, num_barriers=n_buf * n),  # Q and its sink row
            plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=n, num_barriers=stages),
            plgpu.Barrier(num_arrivals=n, num_barriers=stages), plgpu.Barrier(num_arrivals=n),
            plgpu.Barrier(num_barriers=n_buf * n))  # a warpgroup's half of a Q slot released
    body = functools.partial(_forward_kernel, cfg=cfg, work=work, has_sinks=has_sinks,
                             group=hq // hkv, qk_scale=scale * _mgpu.LOG2E)
    out_type = (jax.ShapeDtypeStruct((bsz, s_pad, hq, d), q.dtype),)
    if want_lse:
        out_type += (jax.ShapeDtypeStruct((bsz, hq, s_pad), jnp.float32),)
    out, *lse = _mgpu.kernel_call(
        body, interpret=cfg.interpret, out_type=out_type, grid=(grid,), grid_names=("c",),
        num_threads=n + 1, thread_name="wg", scratch_types=(smem, bars),
    )(qp, kp, vp, sink_rows)
    out = like(out[:, front:front + s], q)
    return out, (like(lse[0][:, :, front:front + s], q) if want_lse else None)
