"""Kernel selection: a Pallas kernel where the spec allows it, the backend runs it and the shapes fit.

`kernels: auto` (the default) lets a lowering take a kernel from tessera/lower/kernels/ when the
kernel's own `supported()` says yes (Hopper GPU, dtype, head dim, ...); otherwise, and always with
`kernels: reference`, the `jax.numpy` reference runs. Every choice is written into the context's
report ({op label: implementation}), which `tessera ir SPEC --after lower` prints.

Inside the sharded train and forward steps (`shard_map` with check_vma) a kernel also has to state over which
mesh axes its outputs vary; a kernel is used there only once it is in SHARD_MAP_VERIFIED, i.e. once
tests/lower/kernels/test_shard_map_gpu.py has passed for it on a GPU. Sharded generation runs without
check_vma and takes the kernels as one device does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.reference import mxfp4
from tessera.lower.reference.attention import attention as attention_reference

REFERENCE = "reference (jax.numpy)"
# kernels checked on a GPU inside the check_vma shard_map of the sharded train/forward steps
SHARD_MAP_VERIFIED: frozenset[str] = frozenset({"flash_attention", "grouped_matmul"})


def _checked_vma(ctx) -> bool:
    return ctx.shard is not None and ctx.mode not in ("prefill", "decode")


def _allowed(ctx, kernel: str) -> bool:
    if _checked_vma(ctx) and kernel not in SHARD_MAP_VERIFIED:
        return False
    return ctx.kernels == "auto" and ctx.backend == "gpu"


def _record(ctx, label: str, choice: str) -> None:
    if ctx.report is not None:
        ctx.report[label] = choice


def _why_not(ctx, kernel: str) -> str:
    if ctx.kernels != "auto":
        return f"{REFERENCE}: kernels = {ctx.kernels}"
    if ctx.backend != "gpu":
        return f"{REFERENCE}: no kernel for backend {ctx.backend}"
    return f"{REFERENCE}: {kernel} not yet verified inside the sharded step (shard_map with check_vma)"


def attention(ctx, label: str, q, k, v, *, sinks, causal, window, scale, q_offset=0):
    """Queries at positions q_offset + 0..S-1 over keys at 0..T-1 (training, forward, prefill).

    Under context parallelism q_offset is traced (it depends on the device): the kernel takes only a static
    offset, so the reference runs.
    """
    if _allowed(ctx, "flash_attention"):
        from tessera.lower.kernels import flash_attention as fa

        static = isinstance(q_offset, int)
        if static and fa.supported(q, k, v, sinks=sinks, causal=causal, window=window, q_offset=q_offset):
            _record(ctx, label, "flash_attention (Pallas, Mosaic GPU)")
            return fa.flash_attention(q, k, v, sinks=sinks, causal=causal, window=window, scale=scale,
                                      q_offset=q_offset)
        why = ("shapes or dtypes outside flash_attention" if static
               else "queries at a per-device offset (context parallel)")
        _record(ctx, label, f"{REFERENCE}: {why}")
    else:
        _record(ctx, label, _why_not(ctx, "flash_attention"))
    return attention_reference(q, k, v, sinks=sinks, causal=causal, window=window, scale=scale, q_offset=q_offset)


def decode(ctx, label: str, q, cache: dict, q_pos, *, sinks, causal, window, scale):
    """New tokens q [B, S, H, D] at absolute positions q_pos [B] against a KV cache that holds them."""
    if _allowed(ctx, "decode_attention") and q.shape[1] == 1:
        from tessera.lower.kernels import decode_attention as da

        if da.supported(q, cache["k"], cache["v"]):
            _record(ctx, label + " (decode)", "decode_attention (Pallas, Mosaic GPU)")
            # the cache fills slots 0, 1, ... in order (a ring of `window` slots for sliding layers):
            # the valid slots are a prefix, and every one of them is visible to the newest token
            kv_len = jnp.minimum(q_pos + 1, cache["k"].shape[1]).astype(jnp.int32)
            return da.decode_attention(q, cache["k"], cache["v"], kv_len=kv_len, sinks=sinks, causal=False,
                                       window=None, scale=scale)
    why = (f"{REFERENCE}: shapes or dtypes outside decode_attention" if _allowed(ctx, "decode_attention")
           else _why_not(ctx, "decode_attention"))
    _record(ctx, label + " (decode)", why)
    return attention_reference(q, cache["k"], cache["v"], sinks=sinks, causal=causal, window=window, scale=scale,
                               q_offset=q_pos, kv_positions=cache["pos"])


def ragged_dot(ctx, label: str):
    """`jax.lax.ragged_dot` or the grouped-GEMM kernel with its semantics, for the MoE experts.

    rhs may be packed (`MXFP4` experts): then the reference dequantises it (tessera/lower/reference/mxfp4.py).
    """
    if not _allowed(ctx, "grouped_matmul"):  # one gate for both MoE kernels: they are verified together
        _record(ctx, label, _why_not(ctx, "grouped_matmul / mxfp4_ragged_dot"))
        return mxfp4.any_ragged_dot
    from tessera.lower.kernels import grouped_matmul as gm

    def dot(lhs, rhs, group_sizes, preferred_element_type=None):
        if isinstance(rhs, mxfp4.MXFP4):
            from tessera.lower.kernels import mxfp4_matmul as mk

            if mk.supported(lhs, rhs, group_sizes):
                _record(ctx, label, "mxfp4_ragged_dot (Pallas, Triton: dequantised in registers)")
                return mk.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)
            _record(ctx, label, f"{REFERENCE}: MXFP4 experts dequantised")
            return mxfp4.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)
        if gm.supported(lhs, rhs, group_sizes):
            _record(ctx, label, "grouped_matmul (Pallas, Mosaic GPU)")
            out = gm.grouped_matmul(lhs, rhs, group_sizes)
            return out.astype(preferred_element_type or out.dtype)
        _record(ctx, label, f"{REFERENCE}: shapes or dtypes outside grouped_matmul")
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)

    return dot


def pair_dot(ctx, label: str):
    """`reference.mxfp4.pair_dot` (row r of lhs times expert experts[r]) or the MXFP4 kernel with its semantics.

    The kernel needs packed experts; plain ones gather their experts' matrices (the reference).
    """
    allowed = _allowed(ctx, "grouped_matmul")  # one gate for the MoE kernels: they are verified together

    def dot(lhs, rhs, experts, preferred_element_type=None):
        if allowed and isinstance(rhs, mxfp4.MXFP4):
            from tessera.lower.kernels import mxfp4_matmul as mk

            if mk.supported_pairs(lhs, rhs, experts):
                _record(ctx, label, "mxfp4_ragged_dot over (token, expert) pairs (Pallas, Triton)")
                return mk.pair_dot(lhs, rhs, experts, preferred_element_type=preferred_element_type)
        _record(ctx, label, f"{REFERENCE}: each (token, expert) pair gathers its expert"
                if allowed else _why_not(ctx, "mxfp4_ragged_dot"))
        return mxfp4.pair_dot(lhs, rhs, experts, preferred_element_type=preferred_element_type)

    return dot
