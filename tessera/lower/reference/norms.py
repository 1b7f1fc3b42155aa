"""Normalisations with fp32 statistics: RMSNorm (GPT-OSS, Llama) and LayerNorm.

x [..., D], scale (and bias) [D]; the result has x's dtype. Hugging Face's GPT-OSS multiplies the
fp32 normalised value by the scale and then casts back; its Llama casts the normalised value back
first and multiplies in the input dtype (`scale_in_input_dtype=True`). In fp32 the two agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.reference._dtypes import wide


def rms_norm(x: jax.Array, *, scale: jax.Array, eps: float, scale_in_input_dtype: bool = False) -> jax.Array:
    """x [..., D] * rsqrt(mean(x^2) + eps) * scale [D], statistics in fp32; returns x's dtype."""
    ct = wide(x.dtype)
    xf = x.astype(ct)
    var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)  # [..., 1]
    normed = xf * jax.lax.rsqrt(var + eps)
    if scale_in_input_dtype:  # Llama's order
        return (scale.astype(x.dtype) * normed.astype(x.dtype)).astype(x.dtype)
    return (scale.astype(ct) * normed).astype(x.dtype)


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
