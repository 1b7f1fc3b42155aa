"""The running tree sum of a device's canonical shards' gradients: measured, and not wired into the train step
(for two shards, where the tree is one add, session 38 wired it in and session 39 took it out again: GPT-OSS-20B's two
layers at C = 2 on one H100 took 162.9 ms a step and peaked at 59.2 GiB against 153.5 ms and 54.2 GiB stacked).

Deterministic mode stacks the m gradients of a device's canonical shards and tree-sums them (`tree_sum`), holding m +
1 gradients. `opaque_fold` folds each shard's gradient into `tree_sum`'s tree as it arrives (a binary counter over the
levels, the adds in the branches of a `lax.switch`), holding log2(m) + 2. With it in `Deterministic.train_step` and
`_per_layer_grads` (session 32): bitwise the same train state (specs/gpt_oss_tiny.yaml, 3 steps, one CPU device),
llama_tiny at C = 8 compiled to 13.27 MiB of temporaries on the CPU against 18.21; but the Llama-1B deterministic
step on one H100 (`bench.e2e`) took 424.8 ms (397.8 at 6f87e16, another session) and peaked at 41.2 GiB (42.7 on an
H200 before; the plan, counting log2(m) + 2 gradients, said 35.9): the GPU program seems to copy the partials that
the switch passes through on every iteration. A form to try: the wide levels stacked in one array written in place
(`dynamic_update_index_in_dim` at level t, outside the switch, whose branches then only read). Pipeline parallelism
in deterministic mode needs the same fold over ticks (docs/parallel.md).

`opaque_fold_in_place` is that form. Compiled temporaries on this machine's CPU (one 16 MiB fp32 gradient a shard,
the leaves as the shard loop types them; XLA's memory analysis):

| leaves, shards | stacked, then `tree_sum` (today) | `opaque_fold` (switch) | `opaque_fold_in_place` |
|---|---|---|---|
| bf16, 8 | 64 MiB | 104 | 72 |
| bf16, 16 | 384 | 136 | 88 |
| fp32, 8 | 128 | 128 | 80 |
| fp32, 16 | 256 | 160 | 96 |

The switch form holds about two more gradients than it should (its pass-through partials are double-buffered, which
fits the H100's result), the in-place form about what it should (log2(n) + 2 wide, the shard's own); at bf16 leaves
and 8 shards stacking is still smallest. To measure on a GPU before it replaces stacking.

    python -m pytest bench/experiments/test_running_tree_sum.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def opaque_fold(fn, xs, n: int, widths: dict):
    """(stacked, summed): fn(x) = (a, g) over the leading axis of xs as `opaque_map` runs it, the a's stacked [n, ...]
    and the g's (a dict of arrays, n a power of two) summed in `tree_sum`'s tree, each widened to `widths[key]`: the
    very adds of `tree_sum(stack(g's).astype(width))`, made as the g's arrive. Arrival i is combined like a binary
    counter: with t the trailing one bits of i, it is added to the partial sums of levels 0 .. t - 1 (each earlier
    partial on the left) and becomes level t's; the last arrival leaves the whole sum at level log2(n). A device
    holds log2(n) + 1 partials (level 0 as fn returns it, narrow where the shard loop's parameters are) where
    stacking held n gradients (`gradient_buffers`). The combining runs in the branches of a `lax.switch` on t: a
    computation of its own, so no add is fused with the arithmetic that made the g's (which then compiles as it
    does stacked)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"opaque_fold sums a power of two of arrivals, not {n}")
    levels = n.bit_length()  # log2(n) + 1
    first = jax.tree.map(lambda a: a[0], xs)
    fn = jax.jit(fn)
    stacked_shape, leaf_shape = jax.eval_shape(fn, first)
    xs = jax.tree.map(lambda a: jnp.concatenate([a, jnp.zeros_like(a[:1])], axis=0), xs)  # as opaque_map
    stacked = jax.tree.map(lambda s: jnp.zeros((n,) + s.shape, s.dtype), stacked_shape)
    partials = tuple({k: jnp.zeros(s.shape, s.dtype if level == 0 else widths[k]) for k, s in leaf_shape.items()}
                     for level in range(levels))

    def carry(t):  # arrival with t trailing ones: the sum of the last 2^t arrivals becomes level t's partial
        def branch(parts, leaf):
            v = leaf if t == 0 else {k: g.astype(widths[k]) for k, g in leaf.items()}
            for level in range(t):  # p[0] + leaf (the latest pair), then p[1] + that, ...: tree_sum's pairs
                v = {k: parts[level][k].astype(widths[k]) + v[k] for k in v}
            return tuple(v if level == t else p for level, p in enumerate(parts))
        return branch

    def body(i, acc):
        out, parts = acc
        a, g = fn(jax.tree.map(lambda arr: jax.lax.dynamic_index_in_dim(arr, i, keepdims=False), xs))
        out = jax.tree.map(lambda buf, v: jax.lax.dynamic_update_index_in_dim(buf, v, i, 0), out, a)
        t = jax.lax.population_count(i ^ (i + 1)) - 1  # trailing ones of i
        return out, jax.lax.switch(t, [carry(level) for level in range(levels)], parts, g)

    out, parts = jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(n)), body, (stacked, partials))
    total = {k: v.astype(widths[k]) for k, v in parts[-1].items()}
    return out, total


def opaque_fold_in_place(fn, xs, n: int, widths: dict):
    """`opaque_fold` with the levels stacked, one wide array a gradient ([log2(n) + 1, ...]), written in place: the
    switch's branches only read the levels (and return the new level's value), and `dynamic_update_index_in_dim`
    writes it at level t outside the switch, so no partial passes through a conditional (the form to measure on a
    GPU, where `opaque_fold`'s pass-through partials seemed to be copied every iteration). Level 0 is held wide
    here: log2(n) + 2 wide gradients and the shard's own."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"opaque_fold_in_place sums a power of two of arrivals, not {n}")
    levels = n.bit_length()
    first = jax.tree.map(lambda a: a[0], xs)
    fn = jax.jit(fn)
    stacked_shape, leaf_shape = jax.eval_shape(fn, first)
    xs = jax.tree.map(lambda a: jnp.concatenate([a, jnp.zeros_like(a[:1])], axis=0), xs)
    stacked = jax.tree.map(lambda s: jnp.zeros((n,) + s.shape, s.dtype), stacked_shape)
    parts = {k: jnp.zeros((levels,) + s.shape, widths[k]) for k, s in leaf_shape.items()}

    def carry(t):  # the value level t takes: the leaf added to levels 0 .. t - 1, nearest first
        def branch(parts, leaf):
            v = {k: g.astype(widths[k]) for k, g in leaf.items()}
            for level in range(t):
                v = {k: parts[k][level] + v[k] for k in v}
            return v
        return branch

    def body(i, acc):
        out, parts = acc
        a, g = fn(jax.tree.map(lambda arr: jax.lax.dynamic_index_in_dim(arr, i, keepdims=False), xs))
        out = jax.tree.map(lambda buf, v: jax.lax.dynamic_update_index_in_dim(buf, v, i, 0), out, a)
        t = jax.lax.population_count(i ^ (i + 1)) - 1
        v = jax.lax.switch(t, [carry(level) for level in range(levels)], parts, g)
        return out, {k: jax.lax.dynamic_update_index_in_dim(parts[k], v[k], t, 0) for k in parts}

    out, parts = jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(n)), body, (stacked, parts))
    return out, {k: v[levels - 1] for k, v in parts.items()}
