"""Deterministic mode's loop over a device's canonical shards: each shard's function compiled apart from what
surrounds it, the same arithmetic for every shard and every mesh: up to two shards each as a conditional's branch
(`per_shard`), more in a loop (`opaque_map`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.fence import fenced

# A device's canonical shards up to which each runs as a conditional's branch of its own rather than in the loop.
# GPT-OSS-20B's two layers at C = 2 on one H100 (session 39, bench/experiments/det_cond.py): 146.2 ms a step and a
# 49.6 GiB peak against the loop's 154.5 ms and 54.2 GiB, the same bits. Each branch is compiled on its own (the
# loop's body once), so more shards stay in the loop.
BRANCHED_UP_TO = 2


def per_shard(fn, xs, n: int):
    """fn over a device's n canonical shards (the leading axis of xs), its results stacked [n, ...]. Up to
    `BRANCHED_UP_TO` shards each runs as the taken branch of a conditional (`fenced`): its results are buffers of its
    own, where the loop copies each shard's into [n, ...] stacks zero-filled first (the stack below is read by its
    consumers, the gradients' tree sum, not written). More run in `opaque_map`'s loop. The shard's function is the
    same computation either way: the same bits (test_train_meshes' meshes, which run 1, 2 and more shards a
    device; and on one H100 the 20b-layers step's parameters after 9 steps, bench/experiments/det_cond.py)."""
    if n > BRANCHED_UP_TO:
        return opaque_map(fn, xs, n)
    fn = jax.jit(fn)  # traced once, for every branch
    outs = [fenced(fn, jax.tree.map(lambda a, i=i: a[i], xs)) for i in range(n)]
    return jax.tree.map(lambda *v: jnp.stack(v), *outs)


def opaque_map(fn, xs, n: int):
    """fn over the leading axis of xs in a loop XLA cannot unroll, inline or hoist from, so the body
    compiles to the same arithmetic for every n (a loop of one would otherwise be fused with its surroundings)."""
    xs, first = _rows(xs, n)
    fn = jax.jit(fn)  # traced once: the loop's body below reuses the trace that gives the shapes (XLA inlines it)
    init = jax.tree.map(lambda s: jnp.zeros((n,) + s.shape, s.dtype), jax.eval_shape(fn, first))

    def body(i, acc):
        return _stacked(acc, fn(_row(xs, i)), i)

    return jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(n)), body, init)


def _rows(xs, n: int):
    """(xs as the loop reads them, their first row). A loop of one gets a spare row (its row i is then not the whole
    array, which XLA would hoist out of the loop); only it: the copy, for the canonical norm's chunks, is of every
    gradient (4.2 G elements, GPT-OSS-20B's two layers)."""
    first = jax.tree.map(lambda a: a[0], xs)
    if n == 1:
        xs = jax.tree.map(lambda a: jnp.concatenate([a, jnp.zeros_like(a[:1])], axis=0), xs)
    return xs, first


def _row(xs, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs)


def _stacked(bufs, values, i):
    return jax.tree.map(lambda buf, v: jax.lax.dynamic_update_index_in_dim(buf, v, i, 0), bufs, values)
