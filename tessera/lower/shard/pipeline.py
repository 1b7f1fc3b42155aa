"""Pipeline parallelism (fast mode): the stacked layers split into stages over `pp`, microbatches
streamed through them with `ppermute` on a GPipe schedule.

The body must be `pre ops → repeat → post ops` (every shipped model is). Each stage holds layers
[s·L/pp, (s+1)·L/pp) (the `layers` dim of stacked parameters is split over pp). At tick t stage 0 feeds
microbatch t, every stage runs its layers on what it holds and passes the result to the next stage; the
last stage collects microbatch t-(pp-1). Gradients flow back through the transposed ppermutes, so the
backward pass runs the same schedule reversed (all forwards, then all backwards: GPipe). The `1f1b`
schedule's gradients come from pipeline_1f1b.py; its loss value alone (no gradient) runs this forward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tessera.ir.types import Region
from tessera.diagnostics import error
from tessera.lower.interpret import eval_region, eval_repeat, period
from tessera.lower.shard.collectives import varying

PP = "pp"


def split_body(body: Region):
    """(ops before, the repeat op, ops after) of a graph body; the pipeline needs exactly one repeat."""
    at = [i for i, op in enumerate(body.ops) if op.name == "repeat"]
    if len(at) != 1:
        raise NotImplementedError("pipeline parallelism needs a model body with exactly one `repeat`")
    i = at[0]
    return body.ops[:i], body.ops[i], body.ops[i + 1:]


def check_stages(options, graph) -> None:
    """Each stage must start on the same step of the per-layer attribute pattern (e.g. GPT-OSS's window on even
    layers), so that its layers can be compiled once for every stage."""
    _, rep, _ = split_body(graph.body)
    n, stages = rep.attrs["n"], options.pp
    p = period(rep.region, n)
    if (n // stages) % p:
        raise error(f"pp={stages} gives stages of {n // stages} layer(s), but the layers' attributes repeat every "
                    f"{p} layers", span=options.span("mesh.pp"), key="mesh.pp",
                    hint=f"use a pp that divides {n // p} (stages of a multiple of {p} layers)")


def pipeline_logits(prog, env, params, tokens, microbatches: int, ctx):
    """Logits of tokens [b, s] through the stages; valid on the last stage (zeros elsewhere)."""
    body = prog.graph.body
    pre, rep, post = split_body(body)
    stages = jax.lax.axis_size(PP)
    stage = jax.lax.axis_index(PP)
    n_local = rep.attrs["n"] // stages
    rep_local = dataclasses.replace(rep, attrs={**rep.attrs, "n": n_local})
    micro = tokens.reshape((microbatches, tokens.shape[0] // microbatches) + tokens.shape[1:])
    pre_region = Region(list(body.args), list(pre), list(rep.values))
    h0 = jax.vmap(lambda t: eval_region(pre_region, [t], params, ctx)[0][0])(micro)  # [M, mb, s, e]
    h0 = varying(h0, (PP,))
    perm = [(j, j + 1) for j in range(stages - 1)]

    def tick(carry, t):
        held, outs = carry
        x = jnp.where(stage == 0, h0[jnp.minimum(t, microbatches - 1)], held)
        (y,), _ = eval_repeat(rep_local, [x], params, ctx, None, prog.options.remat)
        k = t - (stages - 1)
        keep = (stage == stages - 1) & (k >= 0)
        outs = outs.at[jnp.clip(k, 0, microbatches - 1)].set(
            jnp.where(keep, y, outs[jnp.clip(k, 0, microbatches - 1)]))
        return (jax.lax.ppermute(y, PP, perm), outs), None

    init = (varying(jnp.zeros_like(h0[0]), (PP,)), varying(jnp.zeros_like(h0), (PP,)))
    (_, outs), _ = jax.lax.scan(tick, init, jnp.arange(microbatches + stages - 1))
    hidden = outs.reshape((tokens.shape[0],) + outs.shape[2:])
    post_region = Region(list(rep.results), list(post), list(body.outputs))
    (logits,), _ = eval_region(post_region, [hidden], params, ctx)
    return logits, stage == stages - 1
