"""A repeat's fp8 weights quantised once, before its scan: `numerics.default: fp8_e4m3 @scale(per_tensor)` and
`@scale(delayed(H))`.

Inside a repeat's scan each dense fp8 product (linear, attention's q/k/v/o, the MLP's gate/up/down) quantised its
layer's slice of the weight itself, in the forward pass and, because remat replays what a checkpoint policy does not
save, again in the backward. `held_weights` quantises every such stacked weight before the scan instead, layer by
layer as the product would (`reference/fp8.hold`: the weight cast to its op's compute type, its scale from its own
amax, or under delayed scaling from its amax history's weight row), and hands the scan [n, ...] stacks of the fp8
values, scales and amaxes under the weight's path + HELD; interpret._eval_op gives each op its layer's slices
(LowerCtx.fp8_held), and the product multiplies by them (reference/fp8.einsum's `held`). The numbers are those of
quantising in the product, bit for bit (tests/lower/test_fp8_held.py); the weight's gradient is the product's, as
before, and the held copies take none (stop_gradient).

Only where a layer's weight is the whole weight: one device or replicated parameters. Under FSDP or tensor
parallelism (LowerCtx.shard, param_use, tensor) a product quantises the block it gathers, as before. MoE experts'
grouped products and block-scaled (`per_block(N)`) ones quantise in the product.

Deterministic mode on one device runs every canonical shard's layers inside its shard loop (scanned, or unrolled
over weights split before it): there `before_shards` holds the weights once before the loop and each shard reads
the same copies (split into their layers where the loop unrolls), rather than every shard quantising every weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.ir.passes.numerics import fp8_product, fp8_product_dims
from tessera.ir.types import Region
from tessera.lower.context import LowerCtx, jnp_dtype
from tessera.lower.fp8_delayed import HISTORY
from tessera.lower.reference import fp8 as fp8_ref

HELD = "#fp8_held"  # a held weight's key: its path + this; the value {compute dtype name: (w_q, s, amax) stacks}
DENSE = ("linear", "attention", "mlp")  # the ops whose fp8 weights are held (the experts' grouped products are not)


def held_scaling(scaling: str | None) -> bool:
    """Whether products of this fp8 scaling (LowerCtx.fp8, the graph attribute `fp8`) can take held weights:
    per_tensor and delayed(H); per_block(N) quantises blocks in the product."""
    return scaling == "per_tensor" or fp8_ref.delayed_of(scaling) is not None


def holds(ctx: LowerCtx) -> bool:
    """Whether a repeat under `ctx` quantises its fp8 weights before its scan."""
    return held_scaling(ctx.fp8) and ctx.shard is None and ctx.param_use is None and ctx.tensor is None


def held_weights(region: Region, params: dict, stacked: list[str], ctx: LowerCtx, bindings,
                 transposed: bool = False) -> dict:
    """{path + HELD: {dtype: (w_q [n, ...], s [n], amax [n])}} for each of `stacked` (a repeat's stacked parameter
    paths) that a dense op of `region` multiplies in fp8; `bindings(op)` lists an op's (local name, path).
    `transposed`: each with a fourth stack, w_q laid out as the forward product's fp8 GEMM reads it (`hold`'s
    `lead`), for a loop that would otherwise transpose w_q in every iteration (`before_shards`)."""
    if not holds(ctx):
        return {}
    out: dict = {}
    for op in region.ops:
        if op.name not in DENSE:
            continue
        dtype = jnp_dtype(op.values[0].type.dtype)
        for name, path in bindings(op):
            w = params.get(path)
            if path not in stacked or path + HELD in params or not fp8_product(op, name, ctx.fp8_ops) \
                    or not isinstance(w, jax.Array) or not jnp.issubdtype(w.dtype, jnp.floating):
                continue  # (held already: before a deterministic step's shard loop, `before_shards`)
            history = params.get(path + HISTORY)
            lead = fp8_product_dims(op.name, name, op.attrs)[0] if transposed else None
            if history is None:
                held = jax.vmap(lambda a: fp8_ref.hold(a, dtype, lead=lead))(w)
            else:
                held = jax.vmap(lambda a, h: fp8_ref.hold(a, dtype, h, lead=lead))(w, history)
            out.setdefault(path + HELD, {})[jnp.dtype(dtype).name] = jax.lax.stop_gradient(held)
    return out


def held_of(ctx: LowerCtx, name: str, dtype):
    """The op's weight `name` held as quantised from its cast to `dtype`, or None (the product quantises it)."""
    return (ctx.fp8_held.get(name) or {}).get(jnp.dtype(dtype).name) if ctx.fp8_held else None


def before_shards(graph, ctx: LowerCtx, params: dict, history: dict | None, bindings, split) -> dict:
    """The held copies of every stacked fp8 weight of `graph`'s repeats, for a deterministic step's shard loop to
    close over ({path + HELD: ...}; {} where `ctx` holds nothing): from `params` as the loop reads them (precast to
    the compute type, which `hold` casts to anyway) and delayed scaling's `history`; `split(held, {path: n})` cuts
    them into their layers where the loop runs the layers unrolled (layerwise.split; identity otherwise). Each held
    in both layouts its products read (`held_weights`' `transposed`): inside the loop XLA:GPU otherwise transposed
    every fp8 weight for its forward GEMM in every shard (Llama-1B, C = 8: 896 transposes, 9.9 ms of a 360 ms step,
    session 44's profile on one H100). Not differentiated: the weights' gradients come through the products, as in
    the loop."""
    from tessera.lower.interpret import region_param_paths  # (interpret imports this module)

    if not holds(ctx):
        return {}
    merged = {**params, **(history or {})}
    out: dict = {}
    for op in graph.body.ops:
        if op.name == "repeat" and op.attrs.get("axis") is not None:
            n = op.attrs["n"]
            stacked = [path for path in region_param_paths(op.region)
                       if isinstance(params.get(path), jax.Array) and params[path].shape[:1] == (n,)]
            held = held_weights(op.region, merged, stacked, ctx, bindings, transposed=True)
            out.update(split(held, {path: n for path in held}))
    return out
