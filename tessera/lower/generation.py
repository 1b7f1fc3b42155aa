"""The generation program: a prompt's prefill, then a decode loop of a length known only when it runs.

Layers run unrolled over their own weights and KV caches (tessera/lower/interpret.py says why a scan would
copy them every token); stacked weights are split here, copied once per call (held twice meanwhile); split
ones (`Program.init(split_layers=True)`) pass as they are. One compiled program serves every `max_new` up to
`capacity`: the caches hold P + capacity tokens and the loop runs max_new - 1 steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tessera.ir.types import Region
from tessera.lower import sampling
from tessera.lower.interpret import eval_region, init_state, split_layers


def generate_tokens(body: Region, ctx, params, prompts, seed, max_new, capacity: int, rule: sampling.SamplingRule,
                    stop_tokens: tuple[int, ...], shard=None):
    """tokens [B, P + capacity]: the prompts, then max_new sampled tokens (a finished row repeats its stop
    token; slots past max_new are 0). ctx(**kw) -> the unrolled LowerCtx of a phase; shard: the mesh env or None."""
    b, p = prompts.shape
    params = split_layers(body, params)
    state = init_state(body, ctx(mode="prefill"), b, p + capacity)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    whole = (lambda x: x) if shard is None else (lambda x: shard.gather(x, "vocab", axis=-1))
    with jax.named_scope("prefill"):
        (logits,), state = eval_region(body, [prompts], params, ctx(mode="prefill", positions=positions,
                                                                    position_start=0, last_only=True),
                                       state)
    logits = whole(logits)
    key = jax.random.key(seed)
    first = sampling.sample(logits[:, -1], rule, jax.random.fold_in(key, 0))
    done = sampling.is_stop(first, stop_tokens)

    @jax.named_scope("decode")
    def step(i, carry):
        token, done, state, out = carry
        start = (p + i).astype(jnp.int32)
        pos = jnp.full((b, 1), start, jnp.int32)
        (logits,), state = eval_region(body, [token[:, None]], params,
                                       ctx(mode="decode", positions=pos, position_start=start), state)
        logits = whole(logits)
        nxt = sampling.sample(logits[:, -1], rule, jax.random.fold_in(key, i + 1))
        nxt = jnp.where(done, token, nxt)  # a finished row repeats its stop token
        out = jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], i, axis=1)
        return nxt, done | sampling.is_stop(nxt, stop_tokens), state, out

    rest = jnp.zeros((b, capacity - 1), jnp.int32)
    if capacity > 1:  # a loop of max_new - 1 steps, that many known only when it runs (one program for every length)
        _, _, _, rest = jax.lax.fori_loop(0, jnp.minimum(max_new, capacity) - 1, step, (first, done, state, rest))
    return jnp.concatenate([prompts, first[:, None], rest], axis=1)


def generation_fn(prog, params, batch: int, capacity: int, rule: sampling.SamplingRule,
                  stop_tokens: tuple[int, ...] = ()):
    """(params, prompts [batch, P], seed, max_new) -> tokens [batch, P + capacity]: `prog`'s generation program,
    unjitted (`Program.generate_fn`); on a mesh under shard_map (shard/step.py's `sharded_generate`) for `params`
    as held (stacked or split layers; arrays or their shapes)."""
    def run(p, x, s, n, shard=None):
        ctx = functools.partial(prog.lower_ctx, shard=shard, unroll=True)
        return generate_tokens(prog.graph.body, ctx, p, x, s, n, capacity, rule, stop_tokens, shard)

    if prog.plan is None:
        return run
    from tessera.lower.shard.step import sharded_generate
    return sharded_generate(prog.plan, run, batch, prog.param_specs(params))
