"""The `loop` op (tessera/ir/ops_recurrence.py): steps of its region until its `until` region halts every entry of
the carried state, at most `max` of them.

Before each step the halting predicate (`until` on the current state: halted where > 0, or true) marks entries
halted for good; a step leaves a halted entry's state as it was (jnp.where over the predicate's dims).

- Inference (every mode but "train") runs a lax.while_loop that ends once every entry has halted: the remaining
  steps are not run. Under shard_map the devices holding other entries of the predicate agree on whether any is
  still running (a psum), so every device runs as many steps and the collectives inside the body stay paired.
- Training runs a lax.scan of `max` masked steps: the same values, and differentiable (reverse mode cannot go
  through a while loop). The remat policy applies to each step as to a repeat's layers.
- `grad = "last"` in training: the first max - 1 masked steps run on stop_gradient'ed inputs and params, so
  they keep no residuals; the scan also keeps each entry's state before its latest step. One more step then
  runs with the gradient, on that state for an entry that has halted (its last step, run again) and on the
  current state for one still running (its max-th step); an entry that halted before any step keeps its input.
  Carried values the body yields unchanged enter that step as they came in, with their gradient.

Counters (`ctx.aux`) are not collected inside a loop, and a loop keeps no decoding state (no KV cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.ir.ops_recurrence import invariant
from tessera.ir.types import Op
from tessera.lower.context import LowerCtx
from tessera.lower.named import align


def eval_loop(op: Op, ins: list, params: dict, ctx: LowerCtx, layer: int | None, remat: str) -> list:
    """The loop's results: its carried values after the last step."""
    from tessera.lower.interpret import REMAT_POLICIES, eval_region

    ctx = ctx.replace(aux=None, unroll=False)  # one body, traced once: nothing to unroll, no KV cache
    cap, body, until = op.attrs["max"], op.region, op.second
    pdims = until.outputs[0].type.names
    vdims = [a.type.names for a in body.args]

    def halted(state, p):
        (h,), _ = eval_region(until, list(state), p, ctx, layer=layer, scope=f"{op.scope_name}/until")
        return h if h.dtype == jnp.bool_ else h > 0

    def keep(mask, old, new):  # per carried value: `old` where the mask holds, `new` elsewhere
        return tuple(jnp.where(align(mask, pdims, d), o, n) for o, n, d in zip(old, new, vdims))

    def apply(state, p):
        out, _ = eval_region(body, list(state), p, ctx, layer=layer, scope=op.scope_name)
        return tuple(out)

    def step(state, done, p):  # one masked step, then the predicate on its result
        state = keep(done, state, apply(state, p))
        return state, done | halted(state, p)

    ins = tuple(ins)
    if ctx.mode != "train":
        return list(_while(step, ins, halted(ins, params), params, cap, _agree(ctx, pdims)))
    policy = REMAT_POLICIES.get(remat)
    if op.attrs["grad"] != "last":
        def scan_body(carry, _):
            return step(*carry, params), None

        if policy is not None:
            scan_body = jax.checkpoint(scan_body, policy=policy, prevent_cse=False)
        (state, _), _ = jax.lax.scan(scan_body, (ins, halted(ins, params)), None, length=cap)
        return list(state)
    return list(_last_step_grad(op, ins, params, cap, apply, step, halted, keep))


def _agree(ctx: LowerCtx, pdims: tuple[str, ...]):
    """running (a bool scalar) -> whether any device holding another block of the predicate is still running."""
    axes = tuple(dict.fromkeys(a for d in pdims for a in ctx.shard.axes(d))) if ctx.shard is not None else ()
    if not axes:
        return lambda running: running
    return lambda running: jax.lax.psum(running.astype(jnp.int32), axes) > 0


def _while(step, ins, done, params, cap, agree):
    def cond(carry):
        k, _, done = carry
        return (k < cap) & agree(~jnp.all(done))

    def body(carry):
        k, state, done = carry
        return (k + 1, *step(state, done, params))

    _, state, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), ins, done))
    return state


def _last_step_grad(op, ins, params, cap, apply, step, halted, keep):
    """The one-step gradient: max - 1 masked steps without gradient, then each entry's last step with it."""
    sg = jax.lax.stop_gradient
    frozen = jax.tree.map(sg, params)
    state0 = tuple(sg(x) for x in ins)
    done0 = halted(state0, frozen)

    def scan_body(carry, _):
        state, prev, done, took = carry
        prev = keep(done, prev, state)  # the state before this step, for the entries it moves
        state, done_after = step(state, done, frozen)
        return (state, prev, done_after, took | ~done), None

    took0 = jnp.zeros_like(done0)
    (state, prev, done, took), _ = jax.lax.scan(scan_body, (state0, state0, done0, took0), None, length=cap - 1)
    start = keep(done, prev, state)  # halted: the state before its last step; running: the current state
    start = tuple(x if inv else s for x, s, inv in zip(ins, start, invariant(op)))
    out = apply(start, params)
    return keep(done & ~took, ins, out)  # halted before any step: its input
