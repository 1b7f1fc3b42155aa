"""Next-token cross-entropy with fp32 log-sum-exp.

logits [..., V], labels int [...] (already aligned with the logits: the caller shifts), and an
optional mask [...] of tokens that count (1/True) — the rest are ignored, as Hugging Face's
ignore_index = -100. The loss is the mean over counted tokens (0 when none count).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.reference._dtypes import wide


def token_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token -log softmax(logits)[label]: logits [..., V], labels [...] -> fp32 [...]."""
    with jax.named_scope("loss"):  # a row of its own in `tessera profile`
        lf = logits.astype(wide(logits.dtype))
        lse = jax.nn.logsumexp(lf, axis=-1)  # [...]
        picked = jnp.take_along_axis(lf, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return lse - picked


def cross_entropy(logits: jax.Array, labels: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy (fp32 scalar) over tokens where mask [...] is set (all when None)."""
    per_token = token_cross_entropy(logits, labels)
    if mask is None:
        return jnp.mean(per_token)
    m = mask.astype(per_token.dtype)
    return jnp.sum(per_token * m) / jnp.maximum(jnp.sum(m), 1.0)
