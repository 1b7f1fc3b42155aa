"""Expert parallelism in fast mode: token copies dispatched to the experts' shards with all_to_all.

Each device routes only its own tokens (where the expert axes do not split the batch, the devices of an
expert group hold the same tokens and each takes a 1/ep slice of them), packs the routed copies into one
buffer per destination shard, and `all_to_all`s the buffers over the expert axes. A shard sorts what it
received by local expert, runs its experts with `ragged_dot` (d_ff split over the `mlp` axes: partial
sums psum'd), and `all_to_all`s the results back; the source weights and sums each token's k copies.
Autodiff transposes each all_to_all to an all_to_all.

Buffer size (slots per source → destination pair): dropless by default, i.e. the worst case, every copy a
device routes going to one shard: n · min(k, experts per shard) slots for n tokens (a token's k experts are
distinct). That is ep× the average load when experts per shard ≥ k: memory for the dispatch buffers is
bounded by the worst case, not the mean. With `parallel.expert_capacity: f` each destination shard takes at
most ceil(f · n·k / ep) copies from each source (copies in token order, then top-k order); later copies are
dropped (they add nothing: the residual carries the token) and counted.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from tessera.lower.reference import moe as moe_ref
from tessera.lower.reference._dtypes import wide
from tessera.lower.shard.collectives import block_index, varying

COUNTER = "moe_dropped"  # the train step's metric: routed copies dropped by the capacity, summed over layers


def slots(n: int, top_k: int, e_local: int, shards: int, capacity: float | None) -> int:
    """Slots per (source, destination shard) buffer for n routed tokens: dropless, or capped by the factor."""
    dropless = n * min(top_k, e_local)
    if capacity is None or shards == 1:
        return dropless
    return max(1, min(dropless, math.ceil(capacity * n * top_k / shards)))


def pack(experts, valid, e_local: int, shards: int, slots_: int):
    """Where each copy goes: experts int32 [n, k] (global ids), valid bool [n] → (slot, local expert, dropped).

    slot [n·k] indexes the [shards · slots] send buffer (shards · slots: not sent); a copy's position in its
    destination's buffer is its rank among the copies this device sends there, in (token, k) order.
    """
    dest = (experts // e_local).reshape(-1)  # [n·k]
    ok = jnp.repeat(valid, experts.shape[1])
    key = jnp.where(ok, dest, shards)  # padding tokens send nothing
    order = jnp.argsort(key, stable=True)
    counts = jnp.bincount(key, length=shards + 1)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.zeros_like(key).at[order].set(jnp.arange(key.shape[0], dtype=key.dtype) - starts[key[order]])
    kept = ok & (rank < slots_)
    slot = jnp.where(kept, dest * slots_ + rank, shards * slots_)
    return slot, (experts % e_local).reshape(-1), ok & ~kept


def _experts_ffn(env, rows, local_expert, p, *, act, ragged_dot):
    """rows [R, embed] through their local experts (e_local = sentinel: an empty slot) → [R, embed] in fp32."""
    e_local = p["experts/gate"].shape[0]
    order = jnp.argsort(local_expert, stable=True)  # grouped by expert, empty slots last
    sizes = jnp.bincount(local_expert, length=e_local + 1)[:e_local].astype(jnp.int32)
    se = jnp.clip(local_expert[order], 0, e_local - 1)
    ct = wide(rows.dtype)
    rd = functools.partial(ragged_dot, group_sizes=sizes, preferred_element_type=ct)
    xs = rows[order]
    zeros = jnp.zeros((e_local, p["experts/gate"].shape[-1]), ct)
    g = rd(xs, p["experts/gate"]) + p.get("experts/gate_bias", zeros).astype(ct)[se]
    u = rd(xs, p["experts/up"]) + p.get("experts/up_bias", zeros).astype(ct)[se]
    h = act(g.astype(rows.dtype), u.astype(rows.dtype))
    y = env.psum(rd(h, p["experts/down"]), "mlp")  # [R, embed]: whole d_ff
    if "experts/down_bias" in p:
        y = y + p["experts/down_bias"].astype(ct)[se]
    y = jnp.where((local_expert[order] < e_local)[:, None], y, 0.0)
    return jnp.zeros_like(y).at[order].set(y)  # back in slot order


def _my_tokens(env, tokens, rest: tuple[str, ...]):
    """(this device's rows [n, embed], valid [n]): a 1/|rest| slice where `rest` axes hold the same tokens."""
    if not rest:
        return tokens, jnp.ones(tokens.shape[:1], bool)
    ways = env.rules.size(rest)
    n = -(-tokens.shape[0] // ways)
    padded = jnp.pad(varying(tokens, rest), ((0, n * ways - tokens.shape[0]), (0, 0)))
    start = block_index(rest) * n  # row-major over `rest`, the order all_gather puts the slices back in
    valid = start + jnp.arange(n) < tokens.shape[0]
    return jax.lax.dynamic_slice_in_dim(padded, start, n), valid


def _gather_rows(x, axes: tuple[str, ...], total: int):
    """Every device's rows [n, embed] → [total, embed], the same on every device of `axes` (invariant)."""
    whole = jax.lax.all_gather(x, axes, axis=0, tiled=True, to="invarying")
    return whole[:total]


def moe(env, x, p, *, top_k: int, act, ragged_dot=jax.lax.ragged_dot, capacity: float | None = None,
        accum=None):
    """x [b, s, embed] → (y [b, s, embed], dropped copies on this device: int32 scalar); see the module doc."""
    x = env.seq_gather(x)
    b, s, e = x.shape
    ep = env.axes("experts")
    rest = tuple(a for a in ep if a not in env.axes("batch"))  # expert axes over which tokens are the same
    shards = env.rules.size(ep)
    e_local = p["experts/gate"].shape[0]
    tokens, valid = _my_tokens(env, x.reshape(b * s, e), rest)
    if ep:  # routing happens per device on distinct tokens: router grads psum over ep (pcast's transpose)
        tokens = varying(tokens, ep)
        p = {k: (varying(v, ep) if k.startswith("router") else v) for k, v in p.items()}
    n = tokens.shape[0]
    weights, experts = moe_ref.route(tokens, router=p["router"], router_bias=p.get("router_bias"), top_k=top_k,
                                     accum=accum)
    c = slots(n, top_k, e_local, shards, capacity)
    slot, local_expert, dropped = pack(experts, valid, e_local, shards, c)
    copies = jnp.repeat(tokens, top_k, axis=0)  # [n·k, embed], copy j of token t at t·k + j
    send = jnp.zeros((shards * c, e), x.dtype).at[slot].set(copies, mode="drop")
    meta = jnp.full((shards * c,), e_local, jnp.int32).at[slot].set(local_expert, mode="drop")
    a2a = functools.partial(_all_to_all, axes=ep, shards=shards)
    y = _experts_ffn(env, a2a(send), a2a(meta), p, act=act, ragged_dot=ragged_dot)
    back = jnp.concatenate([a2a(y.astype(x.dtype)), jnp.zeros((1, e), x.dtype)])  # + the row dropped copies read
    ct = wide(x.dtype)
    out = jnp.einsum("nke,nk->ne", back[slot].reshape(n, top_k, e).astype(ct), weights.astype(ct))
    if rest:
        out = _gather_rows(out, rest, b * s)
    return env.seq_local(out.reshape(b, s, e)), jnp.sum(dropped, dtype=jnp.int32)


def _all_to_all(buf, *, axes: tuple[str, ...], shards: int):
    """[shards · slots, ...] rows for each destination → [shards · slots, ...] rows from each source."""
    if not axes:
        return buf
    blocks = buf.reshape((shards, buf.shape[0] // shards) + buf.shape[1:])
    return jax.lax.all_to_all(blocks, axes, 0, 0, tiled=True).reshape(buf.shape)


def token_axes(env) -> tuple[str, ...]:
    """Mesh axes over which devices route different tokens (the rest duplicate the same routing)."""
    rules = env.rules
    split = [a for dim in rules.dims(("batch", "seq"), activation=True) for a in dim]
    split = [a for a in split if a not in env.seq_parallel_axes]  # Megatron sp: moe gathers seq first
    return tuple(dict.fromkeys(split + list(env.axes("experts"))))


def step_count(env, local):
    """A per-device count of distinct work (int32) summed over the mesh, the same on every device."""
    sizes = dict(env.rules.sizes)
    every = tuple(sizes)
    dup = math.prod(sizes.values()) // env.rules.size(token_axes(env))
    return jax.lax.psum(varying(local, every), every) // dup
