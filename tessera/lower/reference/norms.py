"""Normalisations with fp32 statistics: RMSNorm (GPT-OSS, Llama) and LayerNorm.

x [..., D], scale (and bias) [D]; the result has x's dtype. As in Hugging Face's GPT-OSS, the
scale multiplies the fp32 normalised value before the cast back (Llama casts first; in fp32 the
two agree).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.reference._dtypes import wide


def rms_norm(x: jax.Array, *, scale: jax.Array, eps: float) -> jax.Array:
    """x [..., D] * rsqrt(mean(x^2) + eps) * scale [D], statistics in fp32; returns x's dtype."""
    ct = wide(x.dtype)
    xf = x.astype(ct)
    var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)  # [..., 1]
    return (scale.astype(ct) * (xf * jax.lax.rsqrt(var + eps))).astype(x.dtype)


def layer_norm(x: jax.Array, *, scale: jax.Array, bias: jax.Array | None = None, eps: float = 1e-5) -> jax.Array:
    """(x [..., D] - mean) * rsqrt(var + eps) * scale [D] + bias [D], statistics in fp32; returns x's dtype."""
    ct = wide(x.dtype)
    xf = x.astype(ct)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)  # biased variance, as torch
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(ct)
    if bias is not None:
        y = y + bias.astype(ct)
    return y.astype(x.dtype)
