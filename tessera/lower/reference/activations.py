"""Activations and gated linear units, computed in fp32 and returned in the input's dtype.

`swiglu` is Llama's MLP nonlinearity, silu(gate) * up. `clamped_swiglu` is GPT-OSS's expert
nonlinearity exactly as Hugging Face computes it:
    gate = min(gate, limit); up = clip(up, -limit, limit)
    out  = (up + 1) * gate * sigmoid(alpha * gate)
(the gate is clamped only from above; the "+1" sits on the linear branch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.reference._dtypes import wide


def silu(x: jax.Array) -> jax.Array:
    """x * sigmoid(x), elementwise, any shape."""
    xf = x.astype(wide(x.dtype))
    return (xf * jax.nn.sigmoid(xf)).astype(x.dtype)


def gelu(x: jax.Array, *, approximate: bool = False) -> jax.Array:
    """GELU, exact erf form by default (torch's default) or the tanh approximation; any shape."""
    return jax.nn.gelu(x.astype(wide(x.dtype)), approximate=approximate).astype(x.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, gate and up [..., F]."""
    g = gate.astype(wide(gate.dtype))
    return (g * jax.nn.sigmoid(g) * up.astype(g.dtype)).astype(gate.dtype)


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float | None) -> jax.Array:
    """GPT-OSS's (clip(up) + 1) * min(gate, limit) * sigmoid(alpha * min(gate, limit)); gate, up [..., F]."""
    g = gate.astype(wide(gate.dtype))
    u = up.astype(g.dtype)
    if limit is not None:
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
    return ((u + 1.0) * (g * jax.nn.sigmoid(alpha * g))).astype(gate.dtype)
