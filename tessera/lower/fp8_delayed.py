"""Delayed fp8 scaling's train state: `numerics.default: fp8_e4m3 @scale(delayed(H))` (`delayed` is H = 16).

Every weight whose product runs in fp8 (`tessera.ir.passes.numerics.fp8_weights`: linear, attention's q/k/v/o, the
MLP's gate/up/down, the experts' grouped gate/up/down) keeps an amax history: fp32 [*stacked, 3, H], its rows the
product's activation, weight and output gradient, column 0 the newest step, zeros where no step has been recorded.
A stacked weight ([layers, ...]) has one history per layer ([layers, 3, H]), sliced by the repeat's scan as the
weight is. The products (tessera/lower/reference/fp8.py: `_delayed`, `_ragged_delayed`) scale each operand by the
power of two from its row's max, or by its current amax where the row holds only zeros (the first step, so step 1
is per_tensor's bit for bit).

The histories are train state: `carrying` wraps the optimizer, and its state `DelayedScalingState(history,
inner)` holds them beside the wrapped optimizer's own state, so a checkpoint saves them and a resumed run goes on
with the same bits. The state is replicated on every device (a few floats a weight).

A train step (tessera/lower/program.py, shard/deterministic.py):
  1. reads the histories (`history_of`) and hands them to the loss function beside the parameters, each under its
     weight's path + HISTORY (`merged`), where `repeat` slices the stacked ones and each op's lowering finds its
     own (interpret._eval_op → LowerCtx.fp8_history);
  2. differentiates with respect to them too: a product's custom VJP returns as their "gradient" zeros with column
     0 the step's [amax x, amax w, amax g]; over canonical shards and microbatches these are combined by max (exact
     and order-free: the numbers do not depend on the mesh), never summed; they are not loss-unscaled (the gradient
     quantised is the scaled one);
  3. after the optimizer update, pushes them into the histories (`pushed`): the newest column in front, the oldest
     dropped. A non-finite amax (an overflowed step, which loss scaling skips) is recorded as 0: no range.

Inference (forward, generate, and a train run's evaluation loss) reads no history: a program's forward takes
parameters only (a checkpoint's, a Hugging Face directory's or fresh ones alike), so delayed scaling's products
there take the current amax, i.e. run as per_tensor. The history describes the ranges of the training steps
just taken; a forward over other data gains nothing from it, and `load_run` results do not then depend on
which step's history a checkpoint happened to hold.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

HISTORY = "#amax_history"  # a history's key: its weight's path + this (no parameter path holds `#`)
OPERANDS = ("input", "weight", "grad")  # a history's rows


class DelayedScalingState(NamedTuple):
    history: dict[str, jax.Array]  # weight path + HISTORY -> fp32 [*stacked, 3, H], column 0 the newest step
    inner: Any                     # the wrapped optimizer's state


def history_length(scaling: str | None) -> int | None:
    """H of a `delayed(H)` scaling (the graph attribute `fp8`), else None."""
    if isinstance(scaling, str) and scaling.startswith("delayed(") and scaling.endswith(")"):
        return int(scaling[len("delayed("):-1])
    return None


def carrying(inner: optax.GradientTransformation, weights: dict[str, int], length: int
             ) -> optax.GradientTransformationExtraArgs:
    """`inner` whose state also holds an all-zero amax history [*leading, 3, length] for each weight path in
    `weights` ({path: number of leading stacked dims}, `fp8_weights`); updates pass through to `inner`."""
    def init_fn(params):
        history = {path + HISTORY: jnp.zeros(tuple(params[path].shape[:lead]) + (len(OPERANDS), length), jnp.float32)
                   for path, lead in weights.items()}
        return DelayedScalingState(history, inner.init(params))

    def update_fn(updates, state, params=None, **extra):
        new_updates, new_inner = inner.update(updates, state.inner, params, **extra)
        return new_updates, DelayedScalingState(state.history, new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def history_of(opt_state) -> dict[str, jax.Array] | None:
    """The amax histories inside an optimizer state `carrying` made, else None."""
    return opt_state.history if isinstance(opt_state, DelayedScalingState) else None


def inner_state(opt_state) -> Any:
    """The wrapped optimizer's own state (opt_state itself when it carries no histories)."""
    return opt_state.inner if isinstance(opt_state, DelayedScalingState) else opt_state


def merged(params: dict, history: dict | None) -> dict:
    """The parameters with the histories beside them, as the loss function takes them in a train step."""
    return params if not history else {**params, **history}


def split(grads: dict, history: dict | None) -> tuple[dict, dict | None]:
    """(the parameters' gradients, the histories' cotangents: each product's amaxes in column 0)."""
    if not history:
        return grads, None
    return {k: v for k, v in grads.items() if k not in history}, {k: grads[k] for k in history}


def pushed(opt_state, amaxes: dict | None):
    """opt_state with each history shifted one step older and the step's amaxes (a cotangent from `split`, column 0;
    non-finite ones as 0) in front."""
    if amaxes is None:
        return opt_state
    history = {}
    for key, old in opt_state.history.items():
        new = amaxes[key][..., :1].astype(old.dtype)
        new = jnp.where(jnp.isfinite(new), new, jnp.zeros_like(new))
        history[key] = jnp.concatenate([new, old[..., :-1]], axis=-1)
    return DelayedScalingState(history, opt_state.inner)

