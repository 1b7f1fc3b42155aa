"""A program's training step, traced and not jitted: `Program.train_step` jits `train_step(prog, ...)`.

Which step runs depends on the program:
- a model with loss entries trained on one objective (collocation points): `objective_step`, the weighted
  terms on the whole batch (the optimizer may be L-BFGS, which re-evaluates the objective);
- deterministic mode: the canonical-shard step (`tessera/lower/shard/deterministic.py`), on a one-device mesh
  or the program's mesh;
- otherwise the fast step: the loss on one device or under `shard_map` (`tessera/lower/shard/step.py`, 1F1B
  gradients through `shard/pipeline_1f1b.py`), accumulated over `task.microbatches` slices, loss scaling and
  delayed fp8 amax histories carried in the optimizer state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from tessera.lower import fp8_delayed, loss_scale


class TrainState(NamedTuple):
    """What a training step carries: the step count, parameters and optimizer state."""

    step: jax.Array
    params: dict[str, jax.Array]
    opt_state: Any


def init_train_state(prog, params) -> TrainState:
    """Step 0 of `prog`'s training with fresh optimizer state, placed where its train step returns it."""
    if prog.optimizer is None:
        raise ValueError("this program was compiled without an optimizer (task is not `train`)")
    state = TrainState(jnp.zeros((), jnp.int32), params, prog.optimizer.init(params))
    if prog.graph.losses:  # L-BFGS's state may hold one buffer twice (each leaf its own, to be donated), and
        # weakly typed scalars the step returns strongly typed (a second compile of the step): neither
        state = jax.tree.map(lambda x: jnp.array(x, dtype=jnp.asarray(x).dtype, copy=True), state)
    return placed(prog, state)


def placed(prog, state: TrainState) -> TrainState:
    """`state` placed where `prog`'s train step returns it (what `init_train_state` does to a fresh state; a
    state edited by hand goes through it too, or the step compiles again for the other placement)."""
    return jax.tree.map(lambda x: _on_mesh(prog, x), state)


def _on_mesh(prog, x):
    """A scalar of the train state (the step, the optimizer's counts and hyperparameters) replicated
    on the mesh, where the train step returns it: left on one device, it gave the first step an input
    placement no later step has, and every sharded run compiled its train step twice (13 s each
    for the tests' tiny GPT-OSS on 8 CPU devices). On one device the deterministic step runs on a
    one-device mesh and returns every array placed on it: the whole state goes there, or the second
    step compiled again (the tests' tiny Llama: half the CPU time of a 5-step fixture). Tracers
    (`tessera plan`'s abstract state) pass."""
    if isinstance(x, jax.core.Tracer) or not hasattr(x, "ndim"):
        return x
    from jax.sharding import NamedSharding, PartitionSpec as P
    if prog.plan is None:
        if prog.deterministic and not (prog.graph.losses and not prog.canonical_objective):
            return jax.device_put(x, NamedSharding(prog.deterministic_executor().mesh, P()))
        return x
    if getattr(x, "ndim", None) != 0:
        return x
    return jax.device_put(x, NamedSharding(prog.plan.mesh, P()))


def train_step(prog, state: TrainState, batch) -> tuple[TrainState, dict]:
    """(the next state, metrics) after one optimizer step of `prog` over `batch`: loss, grad_norm, lr (with a
    schedule), the named loss terms, moe_dropped (with parallel.expert_capacity), loss scaling's metrics."""
    if prog.graph.losses and not prog.canonical_objective:
        return objective_step(prog, state, batch)
    if prog.deterministic:  # dropless: the whole model per canonical shard
        state, metrics = prog.deterministic_executor().train_step(state, batch)
        return state, {**metrics, **_counters(prog, {})}
    m = prog.options.grad_accumulation
    ls = loss_scale.state_of(state.opt_state)  # None unless the loss is scaled (lower/loss_scale.py)
    history = fp8_delayed.history_of(state.opt_state)  # delayed fp8 scaling's amax histories (fp8_delayed.py)

    def scaled(params, batch):
        loss, counts = _loss_and_counts(prog, params, batch)
        return (loss if ls is None else loss * ls.scale), counts

    grad_fn = jax.value_and_grad(scaled, has_aux=True)
    inputs = fp8_delayed.merged(state.params, history)  # the histories beside the params: their "gradients" are
    # the step's amaxes
    if m == 1:  # no accumulator: the gradients are the backward pass's own buffers
        (loss, counts), grads = grad_fn(inputs, batch)
        grads, amaxes = fp8_delayed.split(grads, history)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)  # as the accumulator holds them
        counts = jax.tree.map(lambda c: c[None], counts)
    else:
        micro = jax.tree.map(lambda a: a.reshape((m, a.shape[0] // m) + a.shape[1:]), batch)

        def accumulate(carry, mb):  # microbatches summed in a fixed order (amaxes: their max)
            (loss, counts), grads = grad_fn(inputs, mb)
            grads, amaxes = fp8_delayed.split(grads, history)
            return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grads),
                    jax.tree.map(jnp.maximum, carry[2], amaxes)), counts

        zero = (jnp.zeros((), jnp.float32),
                jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params),
                None if history is None else jax.tree.map(jnp.zeros_like, history))
        (loss, grads, amaxes), counts = jax.lax.scan(accumulate, zero, micro)
        grads = jax.tree.map(lambda g: g / m, grads)
    if ls is not None:  # unscaled in fp32; a non-finite one makes the optimizer skip the step
        loss = loss / ls.scale
        grads = jax.tree.map(lambda g: g / ls.scale, grads)
    with jax.named_scope("optimizer"):
        updates, opt_state = prog.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        params = jax.tree.map(lambda new, old: new.astype(old.dtype), params, state.params)
    opt_state = fp8_delayed.pushed(opt_state, amaxes)
    metrics = {"loss": loss / m, "grad_norm": optax.tree.norm(grads), **_counters(prog, counts),
               **loss_scale.metrics(opt_state)}
    if prog.lr_fn is not None:
        metrics["lr"] = prog.lr_fn(opt_state)
    return TrainState(state.step + 1, params, opt_state), metrics


def objective_step(prog, state: TrainState, batch) -> tuple[TrainState, dict]:
    """One step on the weighted loss terms (`Program.objective`) over the whole batch; the optimizer may be
    L-BFGS, which re-evaluates the objective in its line search (`value_fn`). The line search ends on the point
    that becomes the next step's params, having taken the objective's value and gradient there: an L-BFGS step
    after the first reuses them (optax's `value_and_grad_from_state`) instead of differentiating the objective
    again, and evaluates the terms forward only, for the metrics. That halves an L-BFGS step whose search
    accepts its first trial. Only where the step's batch is the last step's (`same_batch`): collocation points
    of one draw."""
    stored = linesearch_state(state.opt_state)
    same = same_batch(prog, state.step)
    if stored is None or same is False:
        (loss, terms), grads = jax.value_and_grad(prog.objective, has_aux=True)(state.params, batch)
    else:
        def fresh(params):
            return jax.value_and_grad(prog.objective, has_aux=True)(params, batch)

        def reuse(params):
            return (stored.value, prog.loss_terms(params, batch)), stored.grad

        (loss, terms), grads = jax.lax.cond(jnp.isfinite(stored.value) & same, reuse, fresh, state.params)
    with jax.named_scope("optimizer"):
        updates, opt_state = prog.optimizer.update(grads, state.opt_state, state.params, value=loss, grad=grads,
                                                   value_fn=lambda p: prog.objective(p, batch)[0])
        params = optax.apply_updates(state.params, updates)
        params = jax.tree.map(lambda new, old: new.astype(old.dtype), params, state.params)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **terms}
    if prog.lr_fn is not None:
        metrics["lr"] = prog.lr_fn(opt_state)
    return TrainState(state.step + 1, params, opt_state), metrics


def same_batch(prog, step):
    """Whether the train task feeds data step `step` the batch it fed step `step - 1` (what the trainer passes
    `train_step`): collocation points drawn once, or within one draw of `resample_every` steps (a traced bool);
    False for data that changes every step."""
    every = prog.options.resample_every
    if every is None:
        return False
    return jnp.asarray(True) if every == 0 else step % every != 0


def linesearch_state(opt_state):
    """The zoom line search's state inside an L-BFGS optimizer state (its value and gradient at the params it
    accepted: +inf before L-BFGS's first step), or None for an optimizer without one."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByZoomLinesearchState))
             if isinstance(s, optax.ScaleByZoomLinesearchState)]
    return found[0] if len(found) == 1 else None


def _loss_and_counts(prog, params, batch):
    """(loss, {counter: int32 scalar}): the fast sharded loss also returns the step's counters (moe_dropped)."""
    if prog.plan is not None and not prog.deterministic:
        from tessera.lower.shard.step import sharded_loss
        return sharded_loss(prog, prog.plan, counted=True)(params, batch)
    return prog.loss_fn()(params, batch), {}


def _counters(prog, counts: dict) -> dict:
    """Metrics from per-microbatch counters: moe_dropped iff parallel.expert_capacity is set (0 where none drop)."""
    if prog.options.expert_capacity is None:
        return {}
    return {"moe_dropped": jnp.sum(counts.get("moe_dropped", jnp.zeros((), jnp.int32)))}
