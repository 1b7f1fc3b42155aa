"""The shard loop (tessera/lower/shard/shard_loop.py): `opaque_map` and `per_shard` (up to BRANCHED_UP_TO shards
as conditionals' branches, more in the loop) stack a function's results over the leading axis with the bits of the
same function mapped, for one shard (the loop's spare row) as for more."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.shard.shard_loop import BRANCHED_UP_TO, opaque_map, per_shard


def _shard(x):  # a loss and bf16 gradients whose values any other arithmetic would round differently
    return (x.sum(), x[:2]), {"w": x * x, "b": [x[:8] * 3, x[8:16] - 1]}


@pytest.mark.parametrize("loop", [opaque_map, per_shard])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_loop_stacks_each_shards_results_as_mapping_them_does(n, loop):
    rng = np.random.default_rng(n)
    xs = jnp.asarray(rng.standard_normal((n, 512)) * 10.0 ** rng.integers(-3, 4, (n, 1)), jnp.bfloat16)
    got = jax.jit(lambda xs: loop(_shard, xs, n))(xs)
    want = jax.vmap(_shard)(xs)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape == (n,) + w.shape[1:] and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_two_shards_are_branches_and_three_the_loop():
    xs = jnp.ones((3, 512), jnp.bfloat16)
    prims = [{e.primitive.name for e in jax.make_jaxpr(lambda x, n=n: per_shard(_shard, x[:n], n))(xs).eqns}
             for n in (BRANCHED_UP_TO, BRANCHED_UP_TO + 1)]
    assert "while" not in prims[0] and "while" in prims[1]
