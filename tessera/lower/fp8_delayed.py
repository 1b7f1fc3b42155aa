"""Delayed fp8 scaling's train state: `numerics.default: fp8_e4m3 @scale(delayed(H))` (`delayed` is H = 16).

Every weight whose product runs in fp8 (`tessera.ir.passes.numerics.fp8_weights`: linear, attention's q/k/v/o, the
MLP's gate/up/down, the experts' grouped gate/up/down) keeps an amax history: fp32 [*stacked, 3, H], its rows the
product's activation, weight and output gradient, column 0 the newest step, zeros where no step has been recorded
but for the weight row, which starts from the initial weight's amax (`seeded`). A stacked weight ([layers, ...]) has
one history per layer ([layers, 3, H]), sliced by the repeat's scan as the weight is. The products
(tessera/lower/reference/fp8.py: `_delayed`, `_ragged_delayed`, `quantize_delayed`) scale each operand by the power
of two from its row's max alone, so no cast waits on its operand's own reduction; a row of zeros only (the first
step) scales an input by 1 and a gradient by its current amax (at 1 it would underflow e5m2). Step 1 thus scales
weights and gradients as per_tensor does and inputs by 1.

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
    """`inner` whose state also holds an amax history [*leading, 3, length] for each weight path in `weights`
    ({path: number of leading stacked dims}, `fp8_weights`): zeros but for the weight row's newest column, the
    initial weight's amax (per stacked layer), so a first step scales each weight as per_tensor would; updates pass
    through to `inner`."""
    def init_fn(params):
        return DelayedScalingState({path + HISTORY: seeded(params[path], lead, length)
                                    for path, lead in weights.items()}, inner.init(params))

    def update_fn(updates, state, params=None, **extra):
        new_updates, new_inner = inner.update(updates, state.inner, params, **extra)
        return new_updates, DelayedScalingState(state.history, new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def seeded(weight: jax.Array, lead: int, length: int) -> jax.Array:
    """A history fp32 [*weight.shape[:lead], 3, length] of zeros with `weight`'s amax (over all but its `lead`
    stacked dims) as the weight row's newest entry. The fp32 amax and the amax of its bf16 rounding give the same
    power-of-two scale: a scale's boundaries, max_fp8 / 2^k (1.75 · 2^j for e4m3 and e5m2), are bf16 numbers, so
    rounding never carries an amax across one."""
    amax = jnp.max(jnp.abs(weight.astype(jnp.float32)), axis=tuple(range(lead, weight.ndim)))
    history = jnp.zeros(tuple(weight.shape[:lead]) + (len(OPERANDS), length), jnp.float32)
    return history.at[..., OPERANDS.index("weight"), 0].set(amax)


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

