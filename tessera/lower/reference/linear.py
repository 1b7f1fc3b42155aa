"""Dense projections, embedding lookup and unembedding; matmuls accumulate in fp32.

Weights are stored input-major (`[in..., out...]`), as docs/contracts.md lays them out: a
Hugging Face `nn.Linear` weight [out, in] is its transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.reference._dtypes import wide


def linear(x: jax.Array, *, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """x [..., I] @ weight [I, *O] (+ bias [*O]) -> [..., *O] in x's dtype, fp32 accumulation."""
    y = jnp.tensordot(x, weight.astype(x.dtype), axes=([x.ndim - 1], [0]), preferred_element_type=wide(x.dtype))
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(x.dtype)


def plus_bias(y, bias):
    """y + bias in fp32 (f64 for f64): a product stored in bf16 (named.stored_dtype) is widened before the add."""
    wide_type = jnp.promote_types(y.dtype, jnp.float32)
    return y.astype(wide_type) + bias.astype(wide_type)


def project_out(x: jax.Array, *, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """x [..., H, Dh] contracted with weight [H, Dh, O] (+ bias [O]) -> [..., O]; attention's output projection."""
    y = jnp.tensordot(x, weight.astype(x.dtype), axes=([x.ndim - 2, x.ndim - 1], [0, 1]),
                      preferred_element_type=wide(x.dtype))
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(x.dtype)


def embed(tokens: jax.Array, *, table: jax.Array) -> jax.Array:
    """tokens int [...] -> rows of table [V, D] -> [..., D]."""
    return jnp.take(table, tokens, axis=0)


def unembed(x: jax.Array, *, weight: jax.Array | None = None, table: jax.Array | None = None) -> jax.Array:
    """Logits [..., V] from x [..., D] and weight [D, V], or the tied embedding table [V, D]; fp32 accumulation."""
    if (weight is None) == (table is None):
        raise ValueError("unembed needs exactly one of weight [D, V] or a tied table [V, D]")
    w = weight if weight is not None else table.T
    return jnp.einsum("...d,dv->...v", x, w.astype(x.dtype), preferred_element_type=wide(x.dtype)).astype(x.dtype)
