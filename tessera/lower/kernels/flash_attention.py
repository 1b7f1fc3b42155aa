"""Flash attention for Hopper (Mosaic GPU): GQA, causal, sliding window, per-head sinks; fwd + bwd.

The public op: `flash_attention` (a custom VJP), its `FlashConfig` and `default_config`, the
`supported` test the lowering asks first, and `attention_flops`. The kernels: the forward in
`flash_attention_fwd.py` (persistent, warp-specialised, FlashAttention-3 style), the backward in
`flash_attention_bwd.py` (a dQ and a dK/dV kernel).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tessera.lower.context import REMAT_SAVED
from tessera.lower.kernels import _mgpu
from tessera.lower.kernels._vma import common, like
from tessera.lower.kernels.flash_attention_fwd import _forward
from tessera.lower.reference.attention import attention as attention_reference


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Tile sizes of the forward and backward kernels; `interpret` runs them on the CPU interpreter."""
    block_q: int = 64  # query rows per compute warpgroup; a work item is 2 warpgroups' rows
    block_kv: int = 128
    stages: int = 2  # K/V tiles in flight
    num_ctas: int | None = None  # persistent grid; None: one CTA per SM
    block_q_bwd: int = 64
    block_kv_bwd: int = 64
    interpret: bool = False

    def __post_init__(self):
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
            if getattr(self, name) % 64:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of 64")
        if self.stages < 2:
            raise ValueError(f"{self.stages=} must be at least 2")
        if self.num_ctas is not None and self.num_ctas < 1:
            raise ValueError(f"{self.num_ctas=} must be at least 1")


def default_config(head_dim: int, window: int | None = None, causal: bool = True) -> FlashConfig:
    """Measured on an H200 and an H100 (docs/kernels-log.md, "Attention forward"): 128-key tiles and a
    4-deep ring (D 64) where blocks on the causal or window edge are many; 256-key tiles for D 64 without
    a mask (468 vs 441 TFLOP/s on an H100); the same tiles won with and without a 128 window."""
    if head_dim <= 64 and not causal and window is None:
        return FlashConfig(block_kv=256, stages=2, block_q_bwd=128)
    return FlashConfig(block_kv=128, stages=4 if head_dim <= 64 else 2,
                       block_q_bwd=128 if head_dim <= 64 else 64)


def supported(q, k, v, *, sinks=None, causal=True, window=None, q_offset=0, config=None) -> bool:
    """Whether the kernel can run these arguments here (Hopper GPU, fp16/bf16, head dim 64/128)."""
    del sinks
    cfg = config or default_config(q.shape[-1], window, causal)
    if not (cfg.interpret or _mgpu.on_hopper()):
        return False
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[0] != k.shape[0]:
        return False
    if q.shape[-1] not in (64, 128) or k.shape[-1] != q.shape[-1] or q.shape[2] % k.shape[2]:
        return False
    if not (jnp.dtype(q.dtype) in _mgpu.HALF_DTYPES and q.dtype == k.dtype == v.dtype):
        return False
    ok_window = window is None or (isinstance(window, int) and window >= 1)
    return ok_window and isinstance(q_offset, int) and q_offset >= 0


# ----------------------------------------------------------------------------- public op


@dataclasses.dataclass(frozen=True)
class _Static:
    causal: bool
    window: int | None
    scale: float
    q_offset: int
    has_sinks: bool
    cfg: FlashConfig


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, sinks, st: _Static):
    # without a gradient nothing reads the statistics; not storing them measured 206-211 against
    # 223-233 us for window 128 + sinks at D64 on an H200 (docs/kernels-log.md)
    out, _ = _forward(q, k, v, sinks, causal=st.causal, window=st.window, scale=st.scale,
                      q_offset=st.q_offset, cfg=st.cfg, has_sinks=st.has_sinks, want_lse=False)
    return out


def _flash_fwd(q, k, v, sinks, st: _Static):
    out, lse = _forward(q, k, v, sinks, causal=st.causal, window=st.window, scale=st.scale,
                        q_offset=st.q_offset, cfg=st.cfg, has_sinks=st.has_sinks)
    # named so that remat `dots` keeps them (interpret.py): the backward then needs no second forward
    out, lse = checkpoint_name(out, REMAT_SAVED[0]), checkpoint_name(lse, REMAT_SAVED[1])
    return out, (q, k, v, sinks, out, lse)


def _flash_bwd(st: _Static, res, d_out):
    from tessera.lower.kernels.flash_attention_bwd import backward
    q, k, v, sinks, out, lse = res
    dq, dk, dv, dsinks = backward(q, k, v, sinks, out, lse, d_out, causal=st.causal, window=st.window,
                                  scale=st.scale, q_offset=st.q_offset, cfg=st.cfg,
                                  has_sinks=st.has_sinks)
    # inside shard_map each cotangent takes its primal's varying axes (the inputs share one set, see below)
    grads = (dq, dk, dv, dsinks.astype(sinks.dtype))
    return tuple(like(g, x) for g, x in zip(grads, (q, k, v, sinks)))


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, *, sinks=None, causal: bool = True, window: int | None = None,
                    scale: float | None = None, q_offset: int = 0, config: FlashConfig | None = None):
    """Attention as `reference.attention` (q [B,S,Hq,D], k/v [B,T,Hkv,D]) with a custom VJP."""
    cfg = config or default_config(q.shape[-1], window, causal)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    st = _Static(causal, window, scale, q_offset, sinks is not None, cfg)
    sinks_arr = jnp.zeros((q.shape[2],), jnp.float32) if sinks is None else sinks
    # inside shard_map: one varying set for all inputs, so JAX transposes the casts of replicated ones
    # (e.g. sinks) into the psum of their cotangents
    q, k, v, sinks_arr = common(q, k, v, sinks_arr)
    return _flash(q, k, v, sinks_arr, st)


def flash_attention_reference(q, k, v, *, sinks=None, causal=True, window=None, scale=None, q_offset=0):
    """The semantics the kernel matches (tessera/lower/reference/attention.py)."""
    return attention_reference(q, k, v, sinks=sinks, causal=causal, window=window, scale=scale,
                               q_offset=q_offset)


def attention_flops(b, s, t, hq, d, *, causal, window, backward=False) -> float:
    """FLOPs over visible (query, key) pairs; backward counts 2.5x the forward (5 matmuls vs 2)."""
    pairs = _visible_pairs(s, t, causal, window)
    return 4.0 * b * hq * d * pairs * (2.5 if backward else 1.0)


def _visible_pairs(s, t, causal, window) -> int:
    """Number of visible pairs for queries at 0..s-1 (q_offset 0), keys 0..t-1."""
    total = 0
    for i in range(s):
        hi = min(t, i + 1) if causal else t
        lo = 0 if window is None else max(0, i - window + 1)
        total += max(0, hi - lo)
    return total
