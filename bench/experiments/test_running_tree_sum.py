"""`opaque_fold` makes `tree_sum`'s adds, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.experiments.running_tree_sum import opaque_fold, opaque_fold_in_place
from tessera.lower.shard.deterministic import tree_sum


@pytest.mark.parametrize("fold", [opaque_fold, opaque_fold_in_place])
@pytest.mark.parametrize("n", [1, 2, 8, 16])
def test_the_running_tree_sum_makes_tree_sums_adds(n, fold):
    """bf16 leaves of mixed magnitudes (any other order of the adds would round differently), summed widened, the
    rest stacked; a count that is not a power of two is refused."""
    rng = np.random.default_rng(n)
    xs = jnp.asarray(rng.standard_normal((n, 512)) * 10.0 ** rng.integers(-3, 4, (n, 1)), jnp.bfloat16)

    def shard(x):
        return x.sum(), {"w": x * 3, "b": x[:8] * x[:8]}

    stacked, summed = jax.jit(lambda xs: fold(shard, xs, n, {"w": jnp.float32, "b": jnp.float32}))(xs)
    loss, leaves = jax.vmap(shard)(xs)
    np.testing.assert_array_equal(stacked, loss)
    for k, g in leaves.items():
        want = tree_sum(g.astype(jnp.float32))
        assert summed[k].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(summed[k]).view(np.uint32), np.asarray(want).view(np.uint32))
    with pytest.raises(ValueError, match="power of two"):
        fold(shard, xs[:1].repeat(3, 0), 3, {"w": jnp.float32, "b": jnp.float32})
