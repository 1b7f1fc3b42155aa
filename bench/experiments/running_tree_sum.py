"""The running tree sum of a device's canonical shards' gradients: measured, and not wired into the train step yet.

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
