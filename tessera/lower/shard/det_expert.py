"""Deterministic expert parallelism's operators: the experts in canonical chunks, each chunk's grouped products its own.

The next compute split of issue 36's item 2 (docs/parallel.md, the ep bullet). The experts are cut into Q canonical
chunks (E / Q consecutive experts each). Chunk q's grouped products run over the whole sorted buffer of token copies
rolled so the chunk's rows come first: its groups then start at row 0 whatever the other chunks hold, and rows past
its groups give 0. Measured on XLA:CPU, a chunk computed so gives the same outputs, input gradients and weight
gradients alone as beside the other chunks (where `lax.ragged_dot` over all experts does not keep an expert's bits
without the others), so the device that holds a chunk's experts can compute it alone. Each row of the buffer belongs
to one chunk: the chunks' outputs (and, backward, their input gradients) are merged by selecting each row from its
chunk and, across the devices holding the chunks, by an integer sum of bit patterns where one device contributes
each row (exact, -0.0 kept).

Tested as operators (tests/lower/shard/test_det_expert.py: one device's Q chunks against ep=2's halves on 8 host
devices, bitwise) and used by `reference/moe.py`'s `expert_chunks` (spec `parallel.canonical_ep`), whose train step
is `det_tensor.tensor_grads` with ep as the group axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tessera.lower.shard.collectives import from_owner


def _merge_across(x, owned, axes: tuple):
    """Each row from the device that owns it (`owned` [rows] bool here): the others' rows as zero bits, the bit
    patterns summed over `axes` (one device contributes each row: exact)."""
    if not axes:
        return x
    return from_owner(x, owned.reshape(owned.shape + (1,) * (x.ndim - 1)), axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def merge_rows(parts, chunk_of_row, first, axes: tuple = ()):
    """[rows, ...]: row r of parts[chunk_of_row[r] - first] where this device holds that chunk (parts [k, rows, ...]:
    its k chunks from the `first`-th: an int, traced where it is the device's place on the ep axis), merged over
    `axes` from the devices holding the others. Backward: each chunk's cotangent is the rows it owns (zeros
    elsewhere): no sum, so exact."""
    k, rows = parts.shape[0], parts.shape[1]
    local = chunk_of_row - first
    owned = (local >= 0) & (local < k)
    picked = parts[jnp.clip(local, 0, k - 1), jnp.arange(rows)]
    picked = jnp.where(owned.reshape(owned.shape + (1,) * (picked.ndim - 1)), picked, jnp.zeros_like(picked))
    return _merge_across(picked, owned, axes)


def _merge_fwd(parts, chunk_of_row, first, axes):
    return merge_rows(parts, chunk_of_row, first, axes), (chunk_of_row, first, parts.shape[0])


def _merge_bwd(axes, res, g):
    chunk_of_row, first, k = res
    mine = (chunk_of_row[None, :] - first) == jnp.arange(k)[:, None]  # [k, rows]
    gp = jnp.where(mine.reshape(mine.shape + (1,) * (g.ndim - 1)), g[None], jnp.zeros_like(g)[None])
    return gp, None, None


merge_rows.defvjp(_merge_fwd, _merge_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fan_rows(x, chunk_of_row, first, k: int, axes: tuple = ()):
    """x [rows, ...] for each of this device's k chunk computations: [k, rows, ...]. Backward: row r's gradient from
    the chunk that owns it (selected, not summed: the others' rows carry zeros), merged over `axes` as merge_rows'
    forward."""
    return jnp.broadcast_to(x, (k,) + x.shape)


def _fan_fwd(x, chunk_of_row, first, k, axes):
    return fan_rows(x, chunk_of_row, first, k, axes), (chunk_of_row, first)


def _fan_bwd(k, axes, res, g):
    chunk_of_row, first = res
    return merge_rows(g, chunk_of_row, first, axes), None, None


fan_rows.defvjp(_fan_fwd, _fan_bwd)


def rolled(ragged_dot, x, w, group_sizes, start):
    """ragged_dot over all of x's rows rolled by -start (the chunk's rows first), rolled back: the chunk's products in
    their rows, zeros past its groups."""
    y = ragged_dot(jnp.roll(x, -start, axis=0), w, group_sizes=group_sizes)
    return jnp.roll(y, start, axis=0)
