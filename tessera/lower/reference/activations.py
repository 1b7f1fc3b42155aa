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


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, gate and up [..., F].

    Its gradient keeps gate and up only, recomputing the sigmoid: differentiated as written, JAX kept five fp32
    values of [..., F] (gate and up widened, the sigmoid, its derivative, silu), which a layer without a policy holds to
    its backward (deterministic mode under `remat: none`: Llama-1B's step on one H100 peaked 4.8 GiB, 11 %, above
    its plan). The backward computes JAX's own VJP of the expression above, in its order of operations."""
    g = gate.astype(wide(gate.dtype))
    return swiglu_wide(g, up.astype(g.dtype)).astype(gate.dtype)


def swiglu_wide(g, u):
    """silu(g) · u of operands already widened: `swiglu`'s arithmetic (a kernel's tile computes it too)."""
    return g * jax.nn.sigmoid(g) * u


def swiglu_grads_wide(g, u, d):
    """(d gate, d up) of `swiglu_wide(g, u)` for its output gradient d, all widened: JAX's own VJP of that expression,
    in its order of operations (`swiglu`'s backward, and fp8_cast's kernel tile)."""
    sig = jax.nn.sigmoid(g)
    m = d * u
    return m * sig + (g * m) * (sig * (1.0 - sig)), (g * sig) * d


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, dh):
    gate, up = res
    g = gate.astype(wide(gate.dtype))
    dg, du = swiglu_grads_wide(g, up.astype(g.dtype), dh.astype(g.dtype))
    return _summed_to(dg, gate).astype(gate.dtype), _summed_to(du, up).astype(up.dtype)


def _summed_to(x: jax.Array, like: jax.Array) -> jax.Array:
    """x [...] summed over the dims `like` was broadcast along to meet it (an operand's gradient)."""
    lead = x.ndim - like.ndim
    dims = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(like.shape) if n == 1 and x.shape[lead + i] != 1)
    return jnp.sum(x, axis=dims).reshape(like.shape) if dims else x


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float | None) -> jax.Array:
    """GPT-OSS's (clip(up) + 1) * min(gate, limit) * sigmoid(alpha * min(gate, limit)); gate, up [..., F]."""
    g = gate.astype(wide(gate.dtype))
    u = up.astype(g.dtype)
    if limit is not None:
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
    return ((u + 1.0) * (g * jax.nn.sigmoid(alpha * g))).astype(gate.dtype)
