"""Row lookups whose gradients sum repeated rows without a scatter-add (tessera/lower/reference/rows.py): values
and gradients against JAX's own lookup, on fresh random ids with repeats, absent ids and one id everywhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.reference.rows import segment_rows, take_groups, take_rows


def _check(lookup, rows: int, ids: np.ndarray, d: int = 5):
    rng = np.random.default_rng(rows + ids.size)
    table = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal(ids.shape + (d,)), jnp.float32)
    ids = jnp.asarray(ids, jnp.int32)
    loss = lambda f: lambda t: jnp.vdot(f(t, ids), ct)  # noqa: E731
    got, want = jax.grad(loss(lookup))(table), jax.grad(loss(lambda t, i: t[i]))(table)
    assert np.array_equal(lookup(table, ids), table[ids])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.array_equal(np.asarray(got) == 0, np.asarray(want) == 0)  # ids never read get exact zeros
    jaxpr = str(jax.make_jaxpr(jax.grad(loss(lookup)))(table))
    assert "scatter" not in jaxpr


@pytest.mark.parametrize("ids", [np.random.default_rng(0).integers(0, 40, (3, 37)),  # repeats, absent ids
                                 np.full((64,), 7), np.arange(40)[::-1].copy(), np.array([0, 39, 0, 39, 5])])
def test_take_rows_gradient_sums_repeated_rows(ids):
    _check(take_rows, 40, ids)


@pytest.mark.parametrize("ids", [np.sort(np.random.default_rng(1).integers(0, 8, 50)), np.zeros(9, int)])
def test_take_groups_gradient_is_each_groups_sum(ids):
    _check(take_groups, 8, ids, d=6)


def test_segment_rows_of_one_row_and_of_none_of_an_id():
    v = jnp.asarray([[1.0, 2.0]], jnp.float32)
    out = segment_rows(v, jnp.asarray([2], jnp.int32), 4)
    assert np.array_equal(out, [[0, 0], [0, 0], [1, 2], [0, 0]])
