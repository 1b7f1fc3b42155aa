"""The 1F1B pipeline schedule (fast mode): each stage interleaves one microbatch's forward with an older
microbatch's backward, so a stage keeps O(pp) microbatches' inputs alive instead of GPipe's M.

Forward and backward interleave, so the gradient cannot come from differentiating the loss from outside.
Instead the schedule runs inside `shard_map` with an explicit `jax.vjp` per stage and microbatch and
accumulates the parameter gradients itself; `with_1f1b_grads` wraps it as the custom VJP of the (GPipe)
loss, so `jax.value_and_grad(loss)` and everything above it stay unchanged.

The schedule, in ticks (all stages run the same program in lockstep: collectives never sit in
stage-dependent control flow, which XLA's CPU collectives cannot do):

    tick t on stage s:  F of microbatch t - s              (input from stage s-1, or the embedding on stage 0)
                        B of microbatch t - 2(pp-1) + s    (output grad from stage s+1, or the loss on the last)
    then ppermute the F output to s+1 and the input grad to s-1.

The last stage runs B of a microbatch right after its F; stage s holds a microbatch from its F to its B,
2(pp-1-s)+1 ticks, so a ring of K = min(M, 2pp-1) stashed stage inputs suffices (GPipe: all M + pp - 1
ticks' residuals). B recomputes the stage's forward from the stashed input (jax.vjp), so only one
microbatch's residuals are alive at a time. The first stage owns the embedding and the last the final
norm, unembedding and loss of each microbatch; every stage traces them (lockstep) with zero cotangents
where they are not its own. The loss is normalised by the whole batch's token count (psum'd before the
schedule), so summing the microbatches' gradients is exact. Ticks: M + 2(pp-1), each one F and one B
(with its recomputed forward).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tessera.ir.types import Region
from tessera.lower.interpret import eval_region, eval_repeat
from tessera.lower.shard.collectives import varying, vma, vocab_cross_entropy_sums
from tessera.lower.shard.pipeline import PP, split_body


def _stage_fns(prog, plan, count):
    """(embed, layers, loss) of one stage: pre-ops on tokens, this stage's layers, post-ops + mean-loss share."""
    body = prog.graph.body
    pre, rep, post = split_body(body)
    ctx = prog.lower_ctx(mode="train", shard=plan.env)
    rep_local = dataclasses.replace(rep, attrs={**rep.attrs, "n": rep.attrs["n"] // jax.lax.axis_size(PP)})
    pre_region = Region(list(body.args), list(pre), list(rep.values))
    post_region = Region(list(rep.results), list(post), list(body.outputs))
    remat = prog.options.remat

    def embed(p, tokens):  # [mb, s] -> [mb, s, e]
        return eval_region(pre_region, [tokens], p, ctx)[0][0]

    def layers(p, x):  # [mb, s, e] -> [mb, s, e] through this stage's layers
        return eval_repeat(rep_local, [x], p, ctx, None, remat)[0][0]

    def loss(p, y, targets, weights):  # this microbatch's share of the whole batch's mean loss
        (logits,), _ = eval_region(post_region, [y], p, ctx)
        return vocab_cross_entropy_sums(plan.env, logits, targets, weights)[0] / count

    return embed, layers, loss


def _local_value_and_grad(prog, plan, data: tuple[str, ...]):
    """(params, batch) -> (loss, grads) on one device inside shard_map: the 1F1B ticks."""
    m_total = prog.options.pipeline_microbatches

    def local(params, batch):
        stages, s = jax.lax.axis_size(PP), jax.lax.axis_index(PP)
        first, last = s == 0, s == stages - 1
        mask = batch.get("mask")
        w = jnp.ones(batch["tokens"].shape, jnp.float32) if mask is None else mask.astype(jnp.float32)  # [b, s]
        count = jnp.maximum(jax.lax.psum(jnp.sum(w), data) if data else jnp.sum(w), 1.0)
        micro = lambda a: a.reshape((m_total, a.shape[0] // m_total) + a.shape[1:])  # [M, mb, s]
        tok, tgt, wm = micro(batch["tokens"]), micro(batch["targets"]), micro(w)
        # each data shard's and stage's contribution differs: vary the parameters there, sum once at the end
        extra = {k: tuple(a for a in data + (PP,) if a not in vma(v)) for k, v in params.items()}
        p = {k: varying(v, extra[k]) for k, v in params.items()}
        embed, layers, loss = _stage_fns(prog, plan, count)

        def stage(q, x, m):  # the whole stage as a function of (params, stashed input): (output, loss share)
            x = jnp.where(first, embed(q, tok[m]), x)
            y = layers(q, x)
            return y, jnp.where(last, loss(q, y, tgt[m], wm[m]), 0.0)

        y0, l0 = stage(p, embed(p, tok[0]), 0)  # types only (dead code): shapes and vma of the carry
        k = min(m_total, 2 * stages - 1)
        zeros = varying(jnp.zeros(y0.shape, y0.dtype), vma(y0))
        fwd = [(j, j + 1) for j in range(stages - 1)]
        bwd = [(j + 1, j) for j in range(stages - 1)]

        def tick(carry, t):
            recv_f, recv_b, stash, grads, total = carry
            m_f, m_b = t - s, t - 2 * (stages - 1) + s
            ok_f, ok_b = (m_f >= 0) & (m_f < m_total), (m_b >= 0) & (m_b < m_total)
            m_f, m_b = jnp.clip(m_f, 0, m_total - 1), jnp.clip(m_b, 0, m_total - 1)
            slot = m_f % k  # F stores before B reads: the last stage's B is the same microbatch
            stash = stash.at[slot].set(jnp.where(ok_f, recv_f, stash[slot]))
            y = layers(p, jnp.where(first, embed(p, tok[m_f]), recv_f))
            (_, l), pull = jax.vjp(lambda q, x: stage(q, x, m_b), p, stash[m_b % k])
            # an idle slot recomputes zeros or an earlier real input (finite): zero cotangents, exactly zero grads
            gy = varying(jnp.where(ok_b & ~last, recv_b, 0.0).astype(y.dtype), vma(y))
            gq, gx = pull((gy, varying(jnp.where(ok_b & last, 1.0, 0.0).astype(l.dtype), vma(l))))
            grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads, gq)
            total = total + jnp.where(ok_b, l, 0.0)
            return (jax.lax.ppermute(y, PP, fwd), jax.lax.ppermute(gx, PP, bwd), stash, grads, total), None

        grads0 = {n: varying(jnp.zeros(v.shape, jnp.float32), vma(v)) for n, v in p.items()}
        stash0 = varying(jnp.zeros((k,) + y0.shape, y0.dtype), vma(y0))
        init = (zeros, zeros, stash0, grads0, varying(jnp.zeros((), jnp.float32), vma(l0)))
        (_, _, _, grads, total), _ = jax.lax.scan(tick, init, jnp.arange(m_total + 2 * (stages - 1)))
        grads = {n: (jax.lax.psum(g, extra[n]) if extra[n] else g).astype(params[n].dtype) for n, g in grads.items()}
        return jax.lax.psum(total, data + (PP,)), grads

    return local


def pipeline_value_and_grad(prog, plan):
    """(params, batch) -> (mean loss, grads by path): the 1F1B schedule under shard_map."""
    from tessera.lower.shard.step import batch_specs

    def value_and_grad(params, batch):
        specs = batch_specs(plan, batch)
        data = tuple(a for e in specs["tokens"] if e for a in ((e,) if isinstance(e, str) else e))  # split tokens
        fn = jax.shard_map(_local_value_and_grad(prog, plan, data), mesh=plan.mesh,
                           in_specs=(plan.param_specs, specs), out_specs=(P(), plan.param_specs))
        return fn(params, batch)

    return value_and_grad


def with_1f1b_grads(prog, plan, loss):
    """`loss(params, batch)` whose gradient comes from the 1F1B schedule (its value alone: `loss` itself)."""
    value_and_grad = pipeline_value_and_grad(prog, plan)
    fn = jax.custom_vjp(loss)

    def fwd(params, batch):
        return value_and_grad(params, batch)  # (loss, residuals = the gradients)

    def bwd(grads, g):  # d(loss)/d(params) scaled by the loss's cotangent; tokens get none
        return jax.tree.map(lambda x: (g * x).astype(x.dtype), grads), None

    fn.defvjp(fwd, bwd)
    return fn
