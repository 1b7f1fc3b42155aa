"""The training optimizer built from `exp.task`: AdamW, a learning-rate schedule, clipping, weight decay.

`tessera.compile(exp)` hands `build_optimizer(exp)` to the program, whose `train_step` applies it.
The learning rate is an injected hyperparameter, so the current value can be read back from the
optimizer state (`current_lr`) for the step's metrics.
"""

from __future__ import annotations

import types
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from tessera.lower import fp8_delayed, loss_scale

Schedule = Callable[[Any], Any]


def _warmup(lr: float, warmup: int, after: optax.Schedule) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup` steps, then `after` (counted from the warmup's end)."""
    if warmup <= 0:
        return after
    ramp = optax.linear_schedule(0.0, lr, warmup)
    return optax.join_schedules([ramp, after], boundaries=[warmup])


def _cosine(lr: float, steps: int, warmup: int, min_ratio: float) -> optax.Schedule:
    decay = optax.cosine_decay_schedule(lr, max(steps - warmup, 1), alpha=min_ratio)
    return _warmup(lr, warmup, decay)


def _linear(lr: float, steps: int, warmup: int, min_ratio: float) -> optax.Schedule:
    decay = optax.linear_schedule(lr, lr * min_ratio, max(steps - warmup, 1))
    return _warmup(lr, warmup, decay)


def _constant(lr: float, steps: int, warmup: int, min_ratio: float) -> optax.Schedule:
    return _warmup(lr, warmup, optax.constant_schedule(lr))


# schedule kind -> builder(lr, total_steps, warmup_steps, min_lr_ratio)
SCHEDULES: dict[str, Callable[[float, int, int, float], optax.Schedule]] = {
    "warmup_cosine": _cosine,
    "linear": _linear,
    "constant": _constant,
}


DEFAULT_LR = 3e-4  # for tasks without an optimizer section (bench times a train step with it)


def build_schedule(exp) -> optax.Schedule:
    """The learning rate as a function of the optimizer step, from exp.task.{optimizer.lr, schedule, steps}."""
    task, sched = exp.task, getattr(exp.task, "schedule", None)
    if sched is None or getattr(task, "optimizer", None) is None:
        return optax.constant_schedule(DEFAULT_LR)
    kind = getattr(sched, "kind", "warmup_cosine")
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule kind {kind!r}; expected one of {sorted(SCHEDULES)}")
    warmup = int(getattr(sched, "warmup_steps", 0) or 0)
    min_ratio = float(getattr(sched, "min_lr_ratio", 0.0) or 0.0)
    return SCHEDULES[kind](float(task.optimizer.lr), int(task.steps), warmup, min_ratio)


def decay_mask(params: dict[str, jax.Array]) -> dict[str, bool]:
    """Weight decay applies to matrices only: not to norms' scales, biases or sinks (ndim < 2)."""
    return {path: jnp.ndim(value) >= 2 for path, value in params.items()}


def _adamw(learning_rate, b1, b2, eps, weight_decay, momentum) -> optax.GradientTransformation:
    return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)


def _adam(learning_rate, b1, b2, eps, weight_decay, momentum) -> optax.GradientTransformation:
    return optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)


def _sgd(learning_rate, b1, b2, eps, weight_decay, momentum) -> optax.GradientTransformation:
    decay = optax.add_decayed_weights(weight_decay, mask=decay_mask)  # decoupled: added before the lr scaling
    return optax.chain(decay, optax.sgd(learning_rate, momentum=momentum or None))


# optimizer name -> builder(learning_rate, b1, b2, eps, weight_decay, momentum)
OPTIMIZERS = {"adamw": _adamw, "adam": _adam, "sgd": _sgd}


class SwitchState(NamedTuple):
    """The state of `then_lbfgs`: the first optimizer's, L-BFGS's, and the step count."""

    first: Any
    lbfgs: Any
    count: jax.Array


def then_lbfgs(first: optax.GradientTransformation, after: int, memory: int) -> optax.GradientTransformationExtraArgs:
    """`first` for `after` steps, then L-BFGS (optax.lbfgs, zoom line search): one transformation with one state,
    so a checkpoint of either phase resumes. The update needs the objective's `value`, `grad` and `value_fn`."""
    lbfgs = optax.lbfgs(memory_size=memory)

    def init(params):
        return SwitchState(first.init(params), lbfgs.init(params), jnp.zeros((), jnp.int32))

    def update(grads, state, params=None, *, value, grad, value_fn, **extra):
        def use_first(_):
            u, s = first.update(grads, state.first, params)
            return u, s, state.lbfgs

        def use_lbfgs(_):
            u, s = lbfgs.update(grads, state.lbfgs, params, value=value, grad=grad, value_fn=value_fn)
            return u, state.first, s

        u, a, b = jax.lax.cond(state.count < after, use_first, use_lbfgs, None)
        return u, SwitchState(a, b, state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm`, whose norm can be handed in (`update(..., global_norm=n)`): deterministic mode
    updates each device's block of the parameters, where the norm must be that of the whole gradient, summed in
    one canonical order on every mesh (tessera/lower/shard/deterministic.py). Without it, optax's own."""
    clip = optax.clip_by_global_norm(max_norm)

    def update_fn(updates, state, params=None, *, global_norm=None, **extra):
        if global_norm is None:
            return clip.update(updates, state, params)
        keep = global_norm < max_norm  # optax's rule, on the given norm
        return jax.tree.map(lambda t: jax.lax.select(keep, t, (t / global_norm.astype(t.dtype)) * max_norm),
                            updates), state

    return optax.GradientTransformationExtraArgs(clip.init, update_fn)


def build_optimizer(exp) -> optax.GradientTransformation:
    """AdamW (or as exp.task.optimizer.name says) with the schedule, global-norm clipping and weight decay;
    L-BFGS alone (`name: lbfgs`) or after `lbfgs_after` steps of the named optimizer."""
    opt = getattr(exp.task, "optimizer", None)
    if getattr(opt, "name", None) == "lbfgs":
        return optax.lbfgs(memory_size=int(opt.lbfgs_memory))
    first = _build_first(exp, opt)
    after = getattr(opt, "lbfgs_after", None)
    return first if after is None else then_lbfgs(first, int(after), int(opt.lbfgs_memory))


def _build_first(exp, opt) -> optax.GradientTransformation:
    if opt is None:
        opt = types.SimpleNamespace(name="adamw", lr=DEFAULT_LR, b1=0.9, b2=0.95, eps=1e-8, clip_norm=1.0)
    name = getattr(opt, "name", "adamw")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {sorted(OPTIMIZERS)}")
    inner = optax.inject_hyperparams(OPTIMIZERS[name], static_args=("b1", "b2", "eps", "weight_decay", "momentum"))(
        learning_rate=build_schedule(exp), b1=float(opt.b1), b2=float(opt.b2), eps=float(opt.eps),
        weight_decay=float(getattr(opt, "weight_decay", 0.0) or 0.0),
        momentum=float(getattr(opt, "momentum", 0.0) or 0.0))
    clip = getattr(opt, "clip_norm", None)
    if clip:
        out = optax.chain(clip_by_global_norm(float(clip)), inner)
    else:
        out = optax.chain(optax.identity(), inner)  # same state structure with or without clipping
    scaling = loss_scale.policy(exp.numerics) if getattr(exp, "numerics", None) is not None else None
    if scaling is not None:  # skips non-finite steps and carries the scale (tessera/lower/loss_scale.py)
        out = loss_scale.loss_scaled(out, kind=scaling[0], init=scaling[1])
    return out


def current_lr(opt_state) -> jax.Array:
    """The learning rate the last update used, read from the state `build_optimizer`'s optimizer keeps (Adam then
    L-BFGS: Adam's schedule, L-BFGS taking its steps from its line search; L-BFGS alone: 0)."""
    opt_state = fp8_delayed.inner_state(opt_state)  # delayed fp8 scaling's histories beside it
    if isinstance(opt_state, SwitchState):
        return current_lr(opt_state.first)
    inner = loss_scale.inner_state(opt_state)
    if not (isinstance(inner, tuple) and len(inner) > 1 and hasattr(inner[1], "hyperparams")):
        return jnp.zeros((), jnp.float32)
    return inner[1].hyperparams["learning_rate"]
