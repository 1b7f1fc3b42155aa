"""The shard loop (tessera/lower/shard/shard_loop.py): `opaque_fold` sums one or two shards' gradients as they
come with the bits of `tree_sum` over their stack, and stacks the rest as `opaque_map` does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.shard.deterministic import tree_sum
from tessera.lower.shard.shard_loop import FOLD_UP_TO, opaque_fold, opaque_map


def _shard(x):  # a loss and bf16 gradients whose sum rounds differently in any other arithmetic (an fma included)
    return (x.sum(), x[:2]), {"w": x * x, "b": [x[:8] * 3, x[8:16] - 1]}


def _widen(g):
    return jax.tree.map(lambda v: v.astype(jnp.float32), g)


@pytest.mark.parametrize("n", [1, 2])
def test_the_fold_is_tree_sums_bits_and_stacks_the_rest(n):
    rng = np.random.default_rng(n)
    xs = jnp.asarray(rng.standard_normal((n, 512)) * 10.0 ** rng.integers(-3, 4, (n, 1)), jnp.bfloat16)
    (loss, head), summed = jax.jit(lambda xs: opaque_fold(_shard, xs, n, _widen))(xs)
    (want_loss, want_head), leaves = jax.vmap(_shard)(xs)
    np.testing.assert_array_equal(loss, want_loss)
    np.testing.assert_array_equal(head, want_head)
    for got, g in zip(jax.tree.leaves(summed), jax.tree.leaves(leaves)):
        assert got.dtype == jnp.float32
        want = tree_sum(g.astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
    stacked = jax.jit(lambda xs: opaque_map(_shard, xs, n))(xs)
    np.testing.assert_array_equal(stacked[0][0], want_loss)


def test_negative_zeros_sum_as_the_tree_sums_them():
    """The first shard is taken as it is, not added to a zero: -0 + -0 stays -0, as tree_sum's one add leaves it."""
    xs = jnp.full((2, 16), -0.0, jnp.float32)
    _, summed = opaque_fold(lambda x: (x.sum(), {"w": x}), xs, 2, lambda g: g)
    assert np.signbit(np.asarray(summed["w"])).all()


def test_more_shards_than_the_fold_sums_are_refused():
    with pytest.raises(ValueError, match="not 3"):
        opaque_fold(_shard, jnp.zeros((3, 512), jnp.bfloat16), FOLD_UP_TO + 1, _widen)
