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
        # the label's logit selected by comparison, not gathered: the gather's gradient is a scatter into the fp32
        # [..., V] cotangent, which kept it from fusing with the cast back to the logits' type (an fp32 [tokens,
        # vocab] buffer written and read once more a step); the same values, the same bits
        hit = labels[..., None].astype(jnp.int32) == jax.lax.broadcasted_iota(jnp.int32, lf.shape, lf.ndim - 1)
        picked = jnp.sum(jnp.where(hit, lf, 0.0), axis=-1)
        return lse - picked


def cross_entropy(logits: jax.Array, labels: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy (fp32 scalar) over tokens where mask [...] is set (all when None)."""
    per_token = token_cross_entropy(logits, labels)
    if mask is None:
        return jnp.mean(per_token)
    m = mask.astype(per_token.dtype)
    return jnp.sum(per_token * m) / jnp.maximum(jnp.sum(m), 1.0)
