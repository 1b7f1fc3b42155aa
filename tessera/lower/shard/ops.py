"""The sharded forms of the ops whose lowering changes under a split axis: vocab-parallel embedding, and
expert-parallel (× tensor-parallel) mixture of experts."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tessera.lower.reference import moe as moe_ref
from tessera.lower.shard.collectives import varying
from tessera.lower.reference._dtypes import wide


def embed(env, table, ids):
    """table [vocab / tp, embed] rows of ids [b, s]: each device looks up its vocab block, psum'd."""
    if not env.axes("vocab"):
        return env.seq_local(table[ids])
    v_local = table.shape[0]
    local = ids - env.index("vocab") * v_local
    inside = (local >= 0) & (local < v_local)
    x = jnp.where(inside[..., None], table[jnp.clip(local, 0, v_local - 1)], 0).astype(table.dtype)
    return env.reduce_out(x, "vocab")  # one device holds each row: the sum adds zeros, exact


def moe(env, x, p, *, top_k: int, act):
    """x [b, s, embed] through experts split over `experts` axes (and d_ff over `mlp` axes): dropless.

    Every device routes all its tokens with the whole router, runs the copies routed to its experts
    (sorted, `ragged_dot`), psums partial d_ff sums over the mlp axes, weights and combines per token,
    then psums over the expert axes. Expert axes that also split the batch see the gathered tokens and
    reduce-scatter the result back.
    """
    x = env.seq_gather(x)
    e = x.shape[-1]
    shared = tuple(a for a in env.axes("experts") if a in env.axes("batch"))
    if shared:
        x = jax.lax.all_gather(x, shared, axis=0, tiled=True)
    rest = tuple(a for a in env.axes("experts") if a not in shared)
    if rest:  # explicit: replicated inputs become per-device before the expert-local work (transpose: psum)
        x = varying(x, rest)
        p = {k: (varying(v, rest) if k.startswith("router") else v) for k, v in p.items()}
    tokens = x.reshape(-1, e)
    t = tokens.shape[0]
    e_local = p["experts/gate"].shape[0]
    lo = env.index("experts") * e_local
    weights, experts = moe_ref.route(tokens, router=p["router"], router_bias=p.get("router_bias"), top_k=top_k)
    flat = experts.reshape(-1) - lo  # [T*k] local expert id, outside [0, e_local) when not here
    here = (flat >= 0) & (flat < e_local)
    key = jnp.where(here, flat, e_local)  # copies for other devices' experts sort last
    order = jnp.argsort(key, stable=True)
    sorted_e = jnp.clip(key[order], 0, e_local - 1)
    token = order // top_k
    sizes = jnp.bincount(key, length=e_local + 1)[:e_local].astype(jnp.int32)
    ct = wide(x.dtype)
    rd = functools.partial(jax.lax.ragged_dot, group_sizes=sizes, preferred_element_type=ct)
    xs = tokens[token]
    zeros = jnp.zeros((e_local, p["experts/gate"].shape[-1]), ct)
    g = rd(xs, p["experts/gate"]) + p.get("experts/gate_bias", zeros).astype(ct)[sorted_e]
    u = rd(xs, p["experts/up"]) + p.get("experts/up_bias", zeros).astype(ct)[sorted_e]
    h = act(g.astype(x.dtype), u.astype(x.dtype))
    y = env.psum(rd(h, p["experts/down"]), "mlp")  # [T*k, embed]: whole d_ff
    if "experts/down_bias" in p:
        y = y + p["experts/down_bias"].astype(ct)[sorted_e]
    y = jnp.where(here[order][:, None], y * weights.reshape(-1)[order][:, None], 0.0)
    out = jax.ops.segment_sum(y, token, num_segments=t).reshape(x.shape)
    out = jax.lax.psum(out, rest) if rest else out
    if shared:
        out = jax.lax.psum_scatter(out, shared, scatter_dimension=0, tiled=True)
    return env.seq_local(out)
