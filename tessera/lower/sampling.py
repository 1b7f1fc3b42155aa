"""Next-token choice: greedy, or temperature with optional top-k and top-p (nucleus) filtering."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingRule:
    """temperature 0 is greedy; top_k keeps the k most likely tokens, top_p the smallest set with mass ≥ p."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None


def sample(logits, rule: SamplingRule, key) -> jax.Array:
    """One token id per row of logits [B, V] (int32 [B])."""
    logits = logits.astype(jnp.float32)
    if rule.temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / rule.temperature
    if rule.top_k is not None and rule.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, rule.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if rule.top_p is not None and rule.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        keep = mass_before < rule.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def is_stop(tokens, stop_tokens) -> jax.Array:
    """Whether each token is one of the stop tokens (bool, same shape)."""
    if not stop_tokens:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_tokens, jnp.int32))
