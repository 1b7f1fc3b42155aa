"""Row lookups whose gradients sum repeated rows without a scatter-add.

The gradient of a lookup `table[ids]` adds the cotangent rows of equal ids, which JAX writes as a scatter-add.
Under XLA:GPU's deterministic ops (`tessera run`'s default) a scatter-add whose indices may repeat is rewritten
into a sort of every scalar update with its index and a segmented scan: for GPT-OSS-20B's expert biases,
`bias[expert of each copy]` over 16,384 copies of 2,880 values, a sort of 47 million elements, 6 of them a train
step (335 of 518 ms on one H100); for a Llama-1B embedding, a sort of 4 million a canonical shard. The lookups
below compute the same sums in a fixed order from their own operations, whatever the mode:

- `take_rows` (an embedding): the ids sorted once (N keys, not N x D), the cotangent rows gathered in that order,
  equal ids' rows summed by a segmented scan in log2(N) steps (a balanced order, as good as any), each id's
  total read at its run's last row.
- `take_groups` (a per-expert bias read by every copy routed to the expert, few groups): the sums as a one-hot
  product in fp32 at full precision (E x N x F multiply-adds: for 32 experts 3 GFLOP).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _no_grad(ids):
    return np.zeros(ids.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take_rows(table, ids, rows: int):
    return table[ids]


def _take_rows_fwd(table, ids, rows):
    return table[ids], ids


def _take_rows_bwd(rows, ids, g):
    return segment_rows(g.reshape(-1, g.shape[-1]), ids.reshape(-1), rows), _no_grad(ids)


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table [R, D] read at int ids [...] -> [..., D]; its gradient sums repeated ids' rows in a fixed order."""
    return _take_rows(table, ids, table.shape[0])


def segment_rows(values: jax.Array, ids: jax.Array, rows: int) -> jax.Array:
    """[rows, D]: row r the sum of values [N, D]'s rows whose id is r (zeros where none): sorted ids, a segmented
    scan, each run's total read at its last row. No scatter; the same order on every device and in every mode."""
    n = ids.shape[0]
    order = jnp.argsort(ids, stable=True)
    sid = ids[order]
    v = values.at[order].get(unique_indices=True)
    step = 1
    while step < n:  # v[i]: the sum over [i - 2 step + 1, i] within i's run (runs are contiguous once sorted)
        same = (sid[step:] == sid[:-step])[:, None]
        v = v + jnp.concatenate([jnp.zeros_like(v[:step]), jnp.where(same, v[:-step], 0)], axis=0)
        step *= 2
    wanted = jnp.arange(rows, dtype=sid.dtype)
    last = jnp.clip(jnp.searchsorted(sid, wanted, side="right") - 1, 0, n - 1)  # each id's run's last row
    return jnp.where((sid[last] == wanted)[:, None], v[last], jnp.zeros((), v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take_groups(values, ids, groups: int):
    return values[ids]


def _take_groups_fwd(values, ids, groups):
    return values[ids], ids


def _take_groups_bwd(groups, ids, g):
    onehot = (ids[:, None] == jnp.arange(groups, dtype=ids.dtype)).astype(jnp.float32)  # [N, E]
    sums = jnp.einsum("ne,nf->ef", onehot, g.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return sums.astype(g.dtype), _no_grad(ids)


_take_groups.defvjp(_take_groups_fwd, _take_groups_bwd)


def take_groups(values: jax.Array, ids: jax.Array) -> jax.Array:
    """values [E, F] read at int ids [N] -> [N, F], for few groups E; the gradient is each group's sum of its rows,
    as a one-hot product (fp32, full precision)."""
    return _take_groups(values, ids, values.shape[0])
