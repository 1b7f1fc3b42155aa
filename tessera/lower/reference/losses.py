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
    """Per-token -log softmax(logits)[label]: logits [..., V], labels [...] -> fp32 [...].

    Its gradient is the one JAX's autodiff takes of `_token_cross_entropy` (the same operations, so the same bits:
    tests/lower/test_reference_elementwise.py), computed from what the forward kept: the logits as given and two fp32
    numbers a token of the log-sum-exp (its maximum and its sum of exponentials). Under autodiff a computation compiled
    apart (deterministic mode's fenced head) kept the fp32 exponentials [..., V] (GPT-OSS-20B: 3.3 GB a 4,096-token
    shard) or, rematerialised, reduced the logits twice more in the backward (2.4 ms a step there, on one H100)."""
    with jax.named_scope("loss"):  # a row of its own in `tessera profile`
        return _cross_entropy_kept(logits, labels)


def _token_cross_entropy(logits, labels, kept: bool = False):
    """The loss per token; `kept`: also (its maximum, its sum of exponentials), the residuals of its gradient."""
    lf = logits.astype(wide(logits.dtype))
    # jax.nn.logsumexp's operations, spelled out to keep the maximum and the sum
    top = jnp.max(lf, axis=-1, initial=-jnp.inf)
    top = jax.lax.stop_gradient(jax.lax.select(jnp.isfinite(top), top, jnp.zeros_like(top)))
    total = jnp.sum(jnp.exp(lf - top[..., None]), axis=-1)
    lse = jnp.log(jnp.abs(total)) + top
    picked = jnp.sum(jnp.where(_hit(lf, labels), lf, 0.0), axis=-1)
    return (lse - picked, (top, total)) if kept else lse - picked


def _hit(lf, labels):
    # the label's logit selected by comparison, not gathered: the gather's gradient is a scatter into the fp32
    # [..., V] cotangent, which kept it from fusing with the cast back to the logits' type (an fp32 [tokens,
    # vocab] buffer written and read once more a step); the same values, the same bits
    return labels[..., None].astype(jnp.int32) == jax.lax.broadcasted_iota(jnp.int32, lf.shape, lf.ndim - 1)


@jax.custom_vjp
def _cross_entropy_kept(logits, labels):
    return _token_cross_entropy(logits, labels)


def _kept_fwd(logits, labels):
    out, (top, total) = _token_cross_entropy(logits, labels, kept=True)
    return out, (logits, labels, top, total)


def _kept_bwd(res, g):
    """Autodiff's cotangent of the logits, operation for operation: the log-sum-exp's (g / |total| through the
    log and the absolute value, broadcast, times each exponential) plus the selected logit's (-g at the label),
    cast to the logits' type."""
    logits, labels, top, total = res
    lf = logits.astype(wide(logits.dtype))
    through_lse = (g / total)[..., None] * jnp.exp(lf - top[..., None])
    through_label = jnp.where(_hit(lf, labels), -g[..., None], 0.0)
    return (through_lse + through_label).astype(logits.dtype), None


_cross_entropy_kept.defvjp(_kept_fwd, _kept_bwd)


def cross_entropy(logits: jax.Array, labels: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy (fp32 scalar) over tokens where mask [...] is set (all when None)."""
    per_token = token_cross_entropy(logits, labels)
    if mask is None:
        return jnp.mean(per_token)
    m = mask.astype(per_token.dtype)
    return jnp.sum(per_token * m) / jnp.maximum(jnp.sum(m), 1.0)
