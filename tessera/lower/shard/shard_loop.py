"""Deterministic mode's loop over a device's canonical shards: each shard's function compiled once, the same
arithmetic for every shard and every trip count (`opaque_map`), and the loop that sums the shards' gradients as they
come where `tree_sum`'s tree over them is a running sum (`opaque_fold`: two shards or one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A device's canonical shards up to which their gradients are summed as they come (`opaque_fold`): llama_tiny at
# d_model 256, 8 layers, compiled on the CPU to 8.5 % fewer bytes a device at two shards (one device, and fsdp=4 at
# C = 8), 2.7 % more at one (a loop of one stacks nothing to save; the deterministic step folds from two).
FOLD_UP_TO = 2


def folds(m: int) -> bool:
    """Whether a device's m canonical shards' gradients are summed as they come (`opaque_fold`), not stacked."""
    return 1 < m <= FOLD_UP_TO


def opaque_map(fn, xs, n: int):
    """fn over the leading axis of xs in a loop XLA cannot unroll, inline or hoist from, so the body
    compiles to the same arithmetic for every n (a loop of one would otherwise be fused with its surroundings)."""
    xs, first = _rows(xs, n)
    fn = jax.jit(fn)  # traced once: the loop's body below reuses the trace that gives the shapes (XLA inlines it)
    init = jax.tree.map(lambda s: jnp.zeros((n,) + s.shape, s.dtype), jax.eval_shape(fn, first))

    def body(i, acc):
        return _stacked(acc, fn(_row(xs, i)), i)

    return jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(n)), body, init)


def opaque_fold(fn, xs, n: int, widen):
    """(stacked, summed): fn(x) = (a, g) over the leading axis of xs in `opaque_map`'s loop, the a's stacked
    [n, ...] and the g's (a pytree) widened by `widen(g)` and summed as they come, for n <= `FOLD_UP_TO`: the first
    shard's widened g, then that plus the second's, the very bits of `tree_sum(stack(g's).astype(wide))` (its one
    add). Where stacking held n gradients and their sum, this holds the running sum and the shard's own, and writes
    no stack. The g's pass an optimization barrier first, so the add is fused with nothing that made them (a GEMM's
    epilogue, an fma, would add in another rounding); the first shard's is selected as it is, not added to zero
    (-0 + -0 stays -0). The sum is the loop's carry, updated in place (a conditional in its way was copied)."""
    if not 1 <= n <= FOLD_UP_TO:
        raise ValueError(f"opaque_fold sums 1 to {FOLD_UP_TO} shards as they come, not {n}")
    xs, first = _rows(xs, n)
    fn = jax.jit(fn)
    a_shape, g_shape = jax.eval_shape(fn, first)
    stacked = jax.tree.map(lambda s: jnp.zeros((n,) + s.shape, s.dtype), a_shape)
    total = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(widen, g_shape))

    def body(i, acc):
        stacked, total = acc
        a, g = fn(_row(xs, i))
        g = widen(jax.lax.optimization_barrier(g))
        return _stacked(stacked, a, i), jax.tree.map(lambda t, v: jnp.where(i > 0, t + v, v), total, g)

    return jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(n)), body, (stacked, total))


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
