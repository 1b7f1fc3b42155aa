"""The sharded forms of the ops whose lowering changes under a split axis: vocab-parallel embedding, and
expert-parallel (× tensor-parallel) mixture of experts (all_to_all dispatch: expert.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.shard import expert


def embed(env, table, ids):
    """table [vocab / tp, embed] rows of ids [b, s]: each device looks up its vocab block, psum'd."""
    if not env.axes("vocab"):
        return env.seq_local(table[ids])
    v_local = table.shape[0]
    local = ids - env.index("vocab") * v_local
    inside = (local >= 0) & (local < v_local)
    x = jnp.where(inside[..., None], table[jnp.clip(local, 0, v_local - 1)], 0).astype(table.dtype)
    return env.reduce_out(x, "vocab")  # one device holds each row: the sum adds zeros, exact


def moe(env, x, p, *, top_k: int, act, ragged_dot=jax.lax.ragged_dot, aux: dict | None = None, accum=None):
    """x [b, s, embed] through experts split over `experts` axes (and d_ff over `mlp` axes), by all_to_all.

    Dispatch and its buffers: expert.py. `env.expert_capacity` applies only where the caller collects the
    drop count (`aux`, the train step's counters): elsewhere (loss evaluation, forward, generation) dropless.
    """
    capacity = env.expert_capacity if aux is not None else None
    y, dropped = expert.moe(env, x, p, top_k=top_k, act=act, ragged_dot=ragged_dot, capacity=capacity,
                            accum=accum)
    if aux is not None:
        aux[expert.COUNTER] = aux.get(expert.COUNTER, 0) + dropped
    return y
