"""Loss scaling for low-precision (fp16) training: `numerics.loss_scale` / `@loss_scale(...)`.

The train step multiplies the loss by the current scale S before the backward pass, so gradients that
fp16 would flush to zero are held S times larger, and divides the gradients by S (in fp32) before
the optimizer sees them. The optimizer is wrapped (`loss_scaled`): when any gradient is not finite
(the scaled backward overflowed) the step is skipped — parameters and optimizer state stay as they
were — and counted. Dynamic scaling (`dynamic`) starts at S = 2^15, halves S on a skipped step and
doubles it after `interval` clean steps in a row (2000, as torch.amp's GradScaler); static (`static(N)`,
`@loss_scale(N)`) keeps S = N.

S, the clean-step count and the skipped-step count live in the optimizer state (`LossScaleState`, the
first element of the wrapped state), so they are part of the train state: checkpointed, restored on
resume, and the same bits after it. The step's metrics report `loss_scale` and `skipped_steps` (total).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from tessera.lower import fp8_delayed

DYNAMIC_INIT = 2.0 ** 15
DYNAMIC_INTERVAL = 2000


class LossScaleState(NamedTuple):
    scale: jax.Array    # fp32 scalar: what the loss is multiplied by
    good: jax.Array     # int32: clean steps since the scale last changed
    skipped: jax.Array  # int32: steps skipped so far (non-finite gradients)


def policy(numerics) -> tuple[str, float] | None:
    """("dynamic", S0) or ("static", S) from a spec's numerics (numerics.loss_scale, else numerics.default's
    @loss_scale), or None for no loss scaling."""
    text = str(getattr(numerics, "loss_scale", "none") or "none")
    if text == "none":
        ls = getattr(numerics.default, "loss_scale", None)
        if ls is None:
            return None
        return ("dynamic", DYNAMIC_INIT) if ls == "dynamic" else ("static", float(ls))
    if text == "dynamic":
        return ("dynamic", DYNAMIC_INIT)
    return ("static", float(text[len("static("):-1]))


def loss_scaled(inner: optax.GradientTransformation, *, kind: str, init: float,
                interval: int = DYNAMIC_INTERVAL) -> optax.GradientTransformationExtraArgs:
    """`inner` that skips steps whose (already unscaled) gradients are not finite, and keeps the loss scale.
    `update(..., all_finite=f)` hands in whether the whole gradient is finite (deterministic mode updates each
    device's block of it); other extra arguments pass on to `inner`."""
    dynamic = kind == "dynamic"
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return (LossScaleState(jnp.asarray(init, jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)),
                inner.init(params))

    def update_fn(updates, state, params=None, *, all_finite=None, **extra):
        ls, inner_state = state
        finite = all_finite if all_finite is not None else all_finite_of(updates)
        safe = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), updates)
        new_updates, new_inner = inner.update(safe, inner_state, params, **extra)
        new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        new_inner = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_inner, inner_state)
        scale, good = ls.scale, ls.good
        if dynamic:
            good = jnp.where(finite, good + 1, 0)
            grow = good >= interval
            scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale * 0.5)
            good = jnp.where(grow, 0, good)
        skipped = ls.skipped + (~finite).astype(jnp.int32)
        return new_updates, (LossScaleState(scale, good.astype(jnp.int32), skipped), new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def all_finite_of(grads) -> jax.Array:
    """Whether every element of every gradient is finite (a bool scalar)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))


def state_of(opt_state) -> LossScaleState | None:
    """The loss-scale state inside an optimizer state `loss_scaled` made (under delayed fp8 scaling's wrapper,
    tessera/lower/fp8_delayed.py, when there is one), else None."""
    opt_state = fp8_delayed.inner_state(opt_state)
    if isinstance(opt_state, tuple) and len(opt_state) == 2 and isinstance(opt_state[0], LossScaleState):
        return opt_state[0]
    return None


def inner_state(opt_state) -> Any:
    """The wrapped optimizer's own state (opt_state itself when it is neither loss scaled nor carries delayed fp8
    scaling's histories)."""
    opt_state = fp8_delayed.inner_state(opt_state)
    return opt_state[1] if state_of(opt_state) is not None else opt_state


def metrics(opt_state) -> dict:
    """{loss_scale, skipped_steps} of a loss-scaled optimizer state, else {}."""
    ls = state_of(opt_state)
    return {} if ls is None else {"loss_scale": ls.scale, "skipped_steps": ls.skipped}
