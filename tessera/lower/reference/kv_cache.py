"""The KV cache's ring-buffer write: a prefill's or a decode step's k, v joining the cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cache_write(cache, k, v, pos, start=None):
    """Write k, v [B, S, Hkv, D] at absolute positions pos [B, S] into the ring buffer (last C tokens). `start`
    (LowerCtx.position_start): pos is start + 0..S-1 in every row, so where those S slots do not wrap they are one
    slice, written in place by dynamic_update_slice, which XLA fuses with the values' producer (a scatter is a
    kernel of its own: three a layer and token in decode)."""
    c = cache["pos"].shape[1]
    if k.shape[1] > c:  # a prompt longer than a sliding window: only its last C tokens stay
        start = None if start is None else start + (k.shape[1] - c)
        k, v, pos = k[:, -c:], v[:, -c:], pos[:, -c:]
    s = k.shape[1]
    # one slice where the slots do not wrap: one token (a traced start), or a known start (the prompt's 0)
    if start is not None and (s == 1 or (isinstance(start, int) and start % c + s <= c)):
        put = lambda a, x: jax.lax.dynamic_update_slice_in_dim(a, x.astype(a.dtype), start % c, axis=1)  # noqa: E731
        return {"k": put(cache["k"], k), "v": put(cache["v"], v), "pos": put(cache["pos"], pos)}
    rows = jnp.arange(k.shape[0])[:, None]
    slots = pos % c
    # unique (row, slot) pairs: the last C positions fill distinct slots; said so, XLA's deterministic-ops
    # mode writes them as they are instead of ordering possibly colliding writes
    put = lambda a, x: a.at[rows, slots].set(x.astype(a.dtype), unique_indices=True)  # noqa: E731
    return {"k": put(cache["k"], k), "v": put(cache["v"], v), "pos": put(cache["pos"], pos)}
