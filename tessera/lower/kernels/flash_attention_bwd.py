"""Backward of `flash_attention` (Mosaic GPU): a dQ kernel and a dK/dV kernel, warp-specialised.

With P = exp2(S * c - lse) rebuilt from the forward's log2-sum-exp2 (sink included) and
delta = rowsum(dO * O):  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dQ = scale dS K,
dK = scale dS^T Q,  dsink_h = -sum_i exp2(sink_h log2e - lse_i) delta_i.
dQ: a CTA = 2 compute warpgroups x `block_q_bwd` rows; a memory warpgroup streams K/V tiles of the
visible key range. dK/dV: a CTA = 2 compute warpgroups x `block_kv_bwd` keys of one KV head; the
memory warpgroup streams Q/dO/lse/delta tiles of every query head of the group over the query
range that sees those keys, so GQA sums happen in registers and dK/dV are written once.
On a fully visible block the two products reading one streamed tile are issued together (S with
dP; dV with dK) and the next step's operand is built while the second is in flight; blocks the
mask cuts issue one product at a time (registers: docs/kernels-log.md, "Attention backward").
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


@dataclasses.dataclass(frozen=True)
class _Dims:
    bq: int
    bkv: int
    stages: int
    group: int
    qk_scale: float  # scale * log2(e)
    scale: float
    interpret: bool


def _bars(n_resident: int, stages: int, n_streams: int):
    """Barriers: resident-tile loads (one per compute warpgroup each), ring full/free per stream."""
    resident = tuple(plgpu.Barrier(num_barriers=2) for _ in range(n_resident))
    full = tuple(plgpu.Barrier(num_barriers=stages) for _ in range(n_streams))
    free = tuple(plgpu.Barrier(num_arrivals=2, num_barriers=stages) for _ in range(n_streams))
    return resident, full, free


def _split_full_blocks(mask: MaskSpec, block: int) -> bool:
    """Whether a loop runs as masked / fully visible / masked stretches, so that fully visible
    blocks skip the mask and issue their products in pairs. Pays where full blocks dominate:
    causal, or a window of at least `_SPLIT_MIN_WINDOW_BLOCKS` blocks (H100, B4 S4096 D64:
    w1024 2.72 vs 3.97 ms split vs one loop). A narrow window has a block or two fully visible
    per tile and the extra loops (three per query head of the group in dK/dV) cost more than
    the masking saves (w128: 1.38-1.44 vs 1.15-1.17 ms)."""
    return mask.window is None or mask.window >= _SPLIT_MIN_WINDOW_BLOCKS * block


_SPLIT_MIN_WINDOW_BLOCKS = 8


# ----------------------------------------------------------------------------- dQ


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, smem, bars, *,
               dm: _Dims, mask: MaskSpec, num_tiles: int):
    """dQ for rows [r, r + 2*bq) of head h, r = (num_tiles-1-t)*2*bq: stream K/V over the visible
    key blocks. Tiles run last rows first: under a causal mask those see the most keys, so the
    grid's last wave holds the lightest CTAs."""
    q2, do2, lse2, delta2, k_ring, v_ring = smem
    (q_bar, do_bar, lse_bar, delta_bar), (k_full, v_full), (k_free, v_free) = bars
    bq, bkv, interp = dm.bq, dm.bkv, dm.interpret
    b, h, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
    cta_row = (num_tiles - 1 - lax.axis_index("t")) * (2 * bq)
    lo, hi = mask.key_range(cta_row + mask.q_offset, cta_row + 2 * bq - 1 + mask.q_offset, bkv)
    kv_head = lax.div(h, jnp.int32(dm.group))

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        row0 = cta_row + wg * bq
        p0 = row0 + mask.q_offset
        q_smem, do_smem, lse_smem, delta_smem = q2.at[wg], do2.at[wg], lse2.at[wg], delta2.at[wg]
        rows = (b, pl.ds(row0, bq), h)
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_bar.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, do_bar.at[wg])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, pl.ds(row0, bq)], lse_smem, lse_bar.at[wg])
        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, pl.ds(row0, bq)], delta_smem, delta_bar.at[wg])
        for bar in (q_bar, do_bar, lse_bar, delta_bar):
            plgpu.barrier_wait(bar.at[wg])
        lse = _mgpu.load_rows(lse_smem, interpret=interp)
        delta = _mgpu.load_rows(delta_smem, interpret=interp)

        def step(kv, dq, masked):
            slot = lax.rem(kv - lo, dm.stages)
            plgpu.barrier_wait(k_full.at[slot])
            plgpu.barrier_wait(v_full.at[slot])

            def probs(s):
                p = jnp.exp2(s * dm.qk_scale - lax.broadcast_in_dim(lse, s.shape, [0]))
                if masked:
                    p = jnp.where(mask.tile(p0, kv * bkv, (bq, bkv), interpret=interp), p, 0.0)
                return p
            if masked:  # one product at a time: measured faster where the mask is applied
                p = probs(_mgpu.mma(q_smem, k_ring.at[slot], (bq, bkv), transpose_b=True,
                                    interpret=interp))
                dp = _mgpu.mma(do_smem, v_ring.at[slot], (bq, bkv), transpose_b=True, interpret=interp)
            else:
                p, dp = _mgpu.mma_pair((q_smem, k_ring.at[slot]), (do_smem, v_ring.at[slot]),
                                       (bq, bkv), interpret=interp, between=probs)
            plgpu.barrier_arrive(v_free.at[slot])
            ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
            dq = _mgpu.mma(ds.astype(q_smem.dtype), k_ring.at[slot], dq.shape, acc=dq,
                           interpret=interp)
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        dq = _mgpu.zeros((bq, q_smem.shape[-1]), interpret=interp)
        if _split_full_blocks(mask, bkv):
            full_lo, full_hi = mask.full_range(p0, p0 + bq - 1, bkv, lo, hi)
            dq = masked_stretches(step, dq, lo, full_lo, full_hi, hi)
        else:
            dq = lax.fori_loop(lo, hi, functools.partial(step, masked=True), dq)
        q_smem[...] = (dq * dm.scale).astype(q_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        tile = lambda ref: (lambda kv: ref.at[b, pl.ds(kv * bkv, bkv), kv_head])
        _mgpu.stream(lo, hi, dm.stages, [(tile(k_ref), k_ring, k_full, k_free),
                                         (tile(v_ref), v_ring, v_full, v_free)])


# ----------------------------------------------------------------------------- dK / dV


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, smem, bars, *,
                dm: _Dims, mask: MaskSpec, num_q_blocks: int):
    """dK, dV for keys [t*2*bkv, (t+1)*2*bkv) of kv head g: stream Q/dO of its query heads."""
    k2, v2, q_ring, do_ring, lse_ring, delta_ring = smem
    (k_bar, v_bar), fulls, frees = bars
    bq, bkv, interp = dm.bq, dm.bkv, dm.interpret
    b, g, wg = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("wg")
    cta_key = lax.axis_index("t") * (2 * bkv)
    q_lo, q_hi = mask.query_range(cta_key, cta_key + 2 * bkv - 1, bq, num_q_blocks)
    n_q = q_hi - q_lo
    n_steps = n_q * dm.group  # (query head in group, query block) pairs

    def unflatten(step):
        """step -> (query head, first query row)."""
        n = jnp.maximum(n_q, 1)
        return g * dm.group + lax.div(step, n), (q_lo + lax.rem(step, n)) * bq

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        key0 = cta_key + wg * bkv
        k_smem, v_smem = k2.at[wg], v2.at[wg]
        keys = (b, pl.ds(key0, bkv), g)
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem, k_bar.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem, v_bar.at[wg])
        plgpu.barrier_wait(k_bar.at[wg])
        plgpu.barrier_wait(v_bar.at[wg])
        (q_full, do_full, lse_full, delta_full), (q_free, do_free, lse_free, delta_free) = fulls, frees

        def step(i, row0, carry, masked):  # i: the producer's step, row0: its first query row
            dk, dv = carry
            slot = lax.rem(i, dm.stages)
            for bar in (q_full, do_full, lse_full):
                plgpu.barrier_wait(bar.at[slot])

            def probs(st):  # P^T [bkv, bq]
                lse = _mgpu.load_rows(lse_ring.at[slot], interpret=interp, dim=0)
                plgpu.barrier_arrive(lse_free.at[slot])
                pt = jnp.exp2(st * dm.qk_scale - lax.broadcast_in_dim(lse, st.shape, [1]))
                if masked:
                    visible = mask.tile(row0 + mask.q_offset, key0, (bkv, bq), interpret=interp,
                                        transposed=True)
                    pt = jnp.where(visible, pt, 0.0)
                return pt

            def load_delta():  # outside any wgmma's flight: a barrier wait there serialises them
                plgpu.barrier_wait(delta_full.at[slot])
                delta = _mgpu.load_rows(delta_ring.at[slot], interpret=interp, dim=0)
                plgpu.barrier_arrive(delta_free.at[slot])
                return delta

            def grad_scores(pt, dpt, delta):  # dS^T
                return (pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))).astype(k_smem.dtype)

            if masked:  # one product at a time: P^T's bf16 copy dies before dP^T lands
                pt = probs(_mgpu.mma(k_smem, q_ring.at[slot], (bkv, bq), transpose_b=True,
                                     interpret=interp))
                dv = _mgpu.mma(pt.astype(k_smem.dtype), do_ring.at[slot], dv.shape, acc=dv,
                               interpret=interp)
                dpt = _mgpu.mma(v_smem, do_ring.at[slot], (bkv, bq), transpose_b=True, interpret=interp)
                plgpu.barrier_arrive(do_free.at[slot])
                dk = _mgpu.mma(grad_scores(pt, dpt, load_delta()), q_ring.at[slot], dk.shape, acc=dk,
                               interpret=interp)
            else:  # S^T and dP^T issued together, then dV and dK
                pt, dpt = _mgpu.mma_pair((k_smem, q_ring.at[slot]), (v_smem, do_ring.at[slot]),
                                         (bkv, bq), interpret=interp, between=probs)
                delta = load_delta()
                dv, dk = _mgpu.mma_acc_pair((dv, pt.astype(k_smem.dtype), do_ring.at[slot]),
                                            (dk, lambda: grad_scores(pt, dpt, delta), q_ring.at[slot]),
                                            interpret=interp)
                plgpu.barrier_arrive(do_free.at[slot])
            plgpu.barrier_arrive(q_free.at[slot])
            return dk, dv

        def head_steps(j, carry):  # query blocks of the group's j-th head: masked, full, masked
            block_step = lambda qb, c, masked: step(j * n_q + qb - q_lo, qb * bq, c, masked)
            return masked_stretches(block_step, carry, q_lo, full_lo, full_hi, q_hi)

        shape = (bkv, k_smem.shape[-1])
        zero = _mgpu.zeros(shape, interpret=interp)
        if _split_full_blocks(mask, bq):
            full_lo, full_hi = mask.full_query_range(key0, key0 + bkv - 1, bq, q_lo, q_hi)
            dk, dv = lax.fori_loop(q_lo - q_lo, jnp.int32(dm.group), head_steps, (zero, zero))
        else:  # one flat loop over every (head, query block) step, all masked
            dk, dv = lax.fori_loop(q_lo - q_lo, n_steps,
                                   lambda i, c: step(i, unflatten(i)[1], c, True), (zero, zero))
        k_smem[...] = (dk * dm.scale).astype(k_smem.dtype)
        v_smem[...] = dv.astype(v_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[keys])
        plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[keys])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def rows(ref):
            def src(i):
                head, row0 = unflatten(i)
                return ref.at[b, pl.ds(row0, bq), head]
            return src

        def vec(ref):
            def src(i):
                head, row0 = unflatten(i)
                return ref.at[b, head, pl.ds(row0, bq)]
            return src
        srcs = (rows(q_ref), rows(do_ref), vec(lse_ref), vec(delta_ref))
        rings = (q_ring, do_ring, lse_ring, delta_ring)
        _mgpu.stream(q_lo - q_lo, n_steps, dm.stages, list(zip(srcs, rings, fulls, frees)))


# ----------------------------------------------------------------------------- driver


def _pad_seq(x, n: int):
    return x if x.shape[1] == n else jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))


def backward(q, k, v, sinks, out, lse, d_out, *, causal, window, scale, q_offset, cfg, has_sinks):
    """(dq, dk, dv, dsinks) of flash attention given the forward's out and lse [B, Hq, S]."""
    bsz, s, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    bq, bkv = cfg.block_q_bwd, cfg.block_kv_bwd
    s_pad = -(-max(lse.shape[-1], s) // (2 * bq)) * (2 * bq)
    t_pad = -(-t // (2 * bkv)) * (2 * bkv)
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), d_out.astype(jnp.float32))
    dsinks = jnp.zeros((hq,), jnp.float32)
    if has_sinks:  # d lse_i / d sink = exp2(sink log2e - lse_i); d out_i = -p_sink,i out_i
        p_sink = jnp.exp2(sinks.astype(jnp.float32)[None, :, None] * _mgpu.LOG2E - lse[:, :, :s])
        dsinks = -jnp.sum(p_sink * delta, axis=(0, 2))
    # rows past the forward's padding get lse = +inf, so their P is 0 rather than exp2(s)
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, s_pad - lse.shape[-1])), constant_values=jnp.inf)
    delta = jnp.pad(delta, ((0, 0), (0, 0), (0, s_pad - s)))
    qp, dop = _pad_seq(q, s_pad), _pad_seq(d_out.astype(q.dtype), s_pad)
    kp, vp = _pad_seq(k, t_pad), _pad_seq(v, t_pad)
    dm = _Dims(bq, bkv, cfg.stages, hq // hkv, scale * _mgpu.LOG2E, scale, cfg.interpret)
    mask = MaskSpec(causal=causal, window=window, q_offset=q_offset, kv_len=t, keys_padded=t_pad > t)
    tf = _mgpu.smem_transforms(q.dtype)
    ring = lambda rows: plgpu.SMEM((cfg.stages, rows, d), q.dtype, transforms=tf)
    own = lambda rows: plgpu.SMEM((2, rows, d), q.dtype, transforms=tf)
    common = dict(num_threads=3, thread_name="wg", interpret=cfg.interpret)

    dq = _mgpu.kernel_call(
        functools.partial(_dq_kernel, dm=dm, mask=mask, num_tiles=s_pad // (2 * bq)),
        out_type=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        grid=(hq, s_pad // (2 * bq), bsz), grid_names=("h", "t", "b"),
        scratch_types=((own(bq), own(bq), plgpu.SMEM((2, bq), jnp.float32),
                        plgpu.SMEM((2, bq), jnp.float32), ring(bkv), ring(bkv)),
                       _bars(4, cfg.stages, 2)), **common,
    )(qp, kp, vp, dop, lse, delta)

    vec_ring = plgpu.SMEM((cfg.stages, bq), jnp.float32)
    dk, dv = _mgpu.kernel_call(
        functools.partial(_dkv_kernel, dm=dm, mask=mask, num_q_blocks=s_pad // bq),
        out_type=(jax.ShapeDtypeStruct(kp.shape, k.dtype), jax.ShapeDtypeStruct(vp.shape, v.dtype)),
        grid=(hkv, t_pad // (2 * bkv), bsz), grid_names=("g", "t", "b"),
        scratch_types=((own(bkv), own(bkv), ring(bq), ring(bq), vec_ring, vec_ring),
                       _bars(2, cfg.stages, 4)), **common,
    )(qp, kp, vp, dop, lse, delta)
    return dq[:, :s], dk[:, :t], dv[:, :t], dsinks
