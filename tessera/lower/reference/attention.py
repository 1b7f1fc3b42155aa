"""Grouped-query attention with causal and sliding-window masks and learned per-head sinks.

This is the semantics every attention kernel in `tessera/lower/kernels/` must match.

Shapes: q [B, S, Hq, D], k and v [B, T, Hkv, D], Hq a multiple of Hkv (query head h reads kv head
h // (Hq // Hkv)); sinks [Hq] or None; out [B, S, Hq, D].

Positions are absolute: query i sits at `q_offset + i` (q_offset a scalar or a [B] array, used
when decoding against a KV cache), key j at j. Key j is visible to query position p when
  causal:  j <= p
  window:  p - j < window          (the mask (window - 1, 0): `window` keys including p itself)
  kv_len:  j < kv_len              (per-batch valid cache length, for decode with a padded cache)
A KV cache kept as a ring buffer passes `kv_positions` [B, T] instead: key j then sits at
kv_positions[b, j], and a negative position marks an empty slot.
A sink is one extra logit per head that joins the softmax denominator and contributes no value:
  out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m)),  m = max(max_j s_j, sink).
Scores and softmax statistics are fp32; the scores q·k and the product with v accumulate in fp32, or in
`accum` when it is narrower (bf16/fp16: reference/accum.py's blocked accumulation, then widened).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.reference import accum as accum_ref
from tessera.lower.reference._dtypes import wide

_MASKED = -jnp.inf


def attention_mask(s: int, t: int, *, causal: bool, window: int | None, q_offset=0, kv_len=None,
                   kv_positions=None):
    """Boolean mask [B or 1, S, T] of visible (query, key) pairs, positions as in the module doc."""
    q_pos = jnp.asarray(q_offset).reshape(-1, 1, 1) + jnp.arange(s)[None, :, None]  # [B|1, S, 1]
    if kv_positions is None:
        k_pos = jnp.arange(t)[None, None, :]  # [1, 1, T]
    else:
        k_pos = jnp.asarray(kv_positions)[:, None, :]  # [B, 1, T]
    visible = jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), dtype=bool)
    if kv_positions is not None:
        visible &= k_pos >= 0
    if causal:
        visible &= k_pos <= q_pos
    if window is not None:
        visible &= q_pos - k_pos < window
    if kv_len is not None:
        visible &= k_pos < jnp.asarray(kv_len).reshape(-1, 1, 1)
    return visible


def attention(q, k, v, *, sinks=None, causal: bool = True, window: int | None = None,
              scale: float | None = None, q_offset=0, kv_len=None, kv_positions=None, accum=None):
    """Reference attention (see module doc); returns [B, S, Hq, D] in q's dtype."""
    b, s, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    qg = q.reshape(b, s, hkv, group, d)
    ct = wide(q.dtype)  # fp32 statistics (fp64 when the inputs are, for gradient checks)
    acc = accum if accum_ref.narrow(accum) else ct
    scores = accum_ref.einsum("bsngd,btnd->bngst", qg, k, accum=acc, preferred_element_type=ct) * scale
    mask = attention_mask(s, t, causal=causal, window=window, q_offset=q_offset, kv_len=kv_len,
                          kv_positions=kv_positions)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)  # [B, Hkv, G, S, T]
    m = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(ct).reshape(1, hkv, group, 1, 1)
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a fully masked row gives zeros, not NaN
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = accum_ref.einsum("bngst,btnd->bsngd", p.astype(v.dtype), v, accum=acc, preferred_element_type=ct)
    return out.reshape(b, s, hq, d).astype(q.dtype)


def attention_flops(b: int, s: int, t: int, hq: int, d: int, *, causal: bool, window: int | None) -> float:
    """Forward FLOPs actually needed (2 matmuls, 2 FLOPs per MAC), counting only visible pairs."""
    if window is None and not causal:
        pairs = s * t
    else:
        mask = jax.device_get(attention_mask(s, t, causal=causal, window=window, q_offset=t - s))
        pairs = int(mask.sum())
    return 4.0 * b * hq * d * pairs
