"""The compute dtype of statistics and accumulations: fp32, or wider when the inputs are (float64 tests)."""

from __future__ import annotations

import jax.numpy as jnp


def wide(*dtypes) -> jnp.dtype:
    """float32 promoted with the given dtypes: bf16/fp16/fp32 -> fp32, fp64 -> fp64."""
    out = jnp.dtype(jnp.float32)
    for d in dtypes:
        out = jnp.promote_types(out, d)
    return out
