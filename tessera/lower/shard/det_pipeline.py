"""Deterministic mode on a `pp` mesh: the layers' compute split over pipeline stages, one device's bits kept.

Without this, deterministic mode runs pp as a data axis: every device gathers every layer for every canonical
shard. Here stage s holds layers [s·L/S, (s+1)·L/S) (the stacked parameters' `layers` dim split over pp, as stored)
and every canonical shard flows through the stages; the mesh's other axes stay data axes over the shards, as in
`Deterministic._per_layer_grads` (docs/parallel.md, "Design for deterministic mode at scale"). With n_d data devices
and C canonical shards, each pp group of devices runs m = C / n_d shards, data device d the shards j·n_d + d.

The schedule is the 1F1B lockstep of tessera/lower/shard/pipeline_1f1b.py over the m shards: at tick t stage s runs
the forward of shard t − s (its input stashed) and the backward of shard t − 2(S − 1) + s, recomputing the stage from
the stash. Every stage runs the same program (idle ticks compute on a clamped shard, their results never stored);
the embedding runs on stage 0 and the head on the last stage only (`fenced(..., when=stage)`: a conditional whose
VJP skips the backward too).
The model is cut in three pieces (bench/experiments/det_pipeline.py found the cut that keeps the bits):
- the pre ops (the embedding) and the post ops with the loss (the head) each `fenced`, on whole parameters gathered
  over the data axes outside the fence (collectives inside a conditional crashed XLA:CPU);
- the stage's run of the repeat, unfenced, its parameters gathered over the data axes where each layer reads them
  (`layerwise.gather_at_use`, whose VJP sums the data devices' block gradients in device order).
Each shard's gradients are reduced over the data devices as they come (the subtree of n_d leaves that one device's
`tree_sum` builds first), stored in the shard's slot, and the m slots tree-summed at the end: the adds of one
device's tree over the C shards. A table tied between the embedding and the head (Llama's) gets its two uses summed
per shard before that reduction, as one device's autodiff sums them (head side first): the last stage sends each
shard's head-side cotangent to stage 0 (`ppermute`), which holds S of them. Each non-stacked parameter's gradient
comes from the one stage that computes it (stage 0: the embedding's and a tied table's; the last: the head's), its
bits copied to every stage (an integer psum of one device's bits and zeros: exact, -0.0 kept).

What it needs (`plan` says why not, and the step then runs pp as a data axis): a language model whose body is
pre ops | one stacked `repeat` | post ops, C a power of two, every stacked parameter split over pp along its layers
dim and read by one op, no other parameter split over pp, and stages of at least two steps of the layers' scan (a
loop of one step is inlined and fused with its surroundings: GPT-OSS's `sinks` gradient was off in its last bit).
Then a pp mesh gives one device's loss and gradients bit for bit, in every compute type; under delayed fp8 scaling
each stage reads its layers' rows of the amax histories and their amaxes are max-combined over the shards, the data
devices and (gathered) the stages.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tessera.ir.types import ParamRef, Region
from tessera.lower import fp8_delayed
from tessera.lower.interpret import eval_region, eval_repeat, period, stacked_layers
from tessera.lower.reference.losses import token_cross_entropy
from tessera.lower.shard import layerwise
from tessera.lower.shard.collectives import block_index

PP = "pp"
NOT_PER_LAYER = "C not a power of two, or an optimizer that is not elementwise"  # no per-layer step to pipeline


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a program's parameters sit on a pp mesh for the pipelined deterministic step."""

    stages: int
    data_axes: tuple[str, ...]   # the mesh's axes > 1 but pp, in mesh order
    stacked: frozenset[str]      # the repeat's parameters, their layers dim split over pp
    pre_reads: frozenset[str]    # the parameters the pre ops read
    post_reads: frozenset[str]   # the parameters the post ops read (a tied table is in both)


def record(stages: int, why: str) -> dict:
    """What the manifest (`tessera run`) and the plan record of a pp mesh's deterministic train step."""
    return {"stages": stages, "split_compute": not why, "why_not": why or None}


def _reads(ops) -> frozenset[str]:
    """The parameter paths `ops` read."""
    return frozenset(o.path for op in ops for o in op.operands if isinstance(o, ParamRef))


def _split_body(body: Region):
    at = [i for i, op in enumerate(body.ops) if op.name == "repeat"]
    if len(at) != 1:
        return None
    return body.ops[:at[0]], body.ops[at[0]], body.ops[at[0] + 1:]


def plan(graph, shapes: dict, mesh_shape: dict, param_specs: dict, c: int) -> tuple[Layout | None, str]:
    """(the layout, "") where the pipelined step applies to a program of `graph` (its parameters' held `shapes`:
    anything with a `.shape`) on a mesh of `mesh_shape` ({axis: size}) with C = c canonical shards, else (None, why
    not). `tessera plan` asks it too, of the graph alone."""
    stages = mesh_shape.get(PP, 1)
    if stages <= 1:
        return None, "no pp axis"
    why = _unsplit(graph)
    if why:
        return None, why
    pre, rep, post = _split_body(graph.body)
    n = rep.attrs["n"]
    if n % stages:
        return None, f"{n} layers do not split into {stages} stages"
    p = period(rep.region, n)
    steps = (n // stages) // p if (n // stages) % p == 0 else 0
    if steps < 2:
        return None, (f"stages of {n // stages} layer(s) run the layers' scan {steps or 'a partial'} step(s); the "
                      "pipelined step needs at least two")
    data_axes = tuple(a for a, size in mesh_shape.items() if size > 1 and a != PP)
    n_d = math.prod(mesh_shape[a] for a in data_axes)
    if c % n_d or (c // n_d) & (c // n_d - 1) or n_d & (n_d - 1):
        return None, f"C = {c} over {n_d} data devices is not a power of two per device"
    stacked = set(stacked_layers(graph.body, shapes))
    axes_of = lambda e: () if e is None else ((e,) if isinstance(e, str) else tuple(e))  # noqa: E731
    for path, spec in param_specs.items():
        entries = tuple(spec)
        uses_pp = [i for i, e in enumerate(entries) if PP in axes_of(e)]
        if path in stacked and (uses_pp != [0] or axes_of(entries[0]) != (PP,)):
            return None, f"`{path}` is not split over pp along its layers dim alone"
        if path not in stacked and uses_pp:
            return None, f"`{path}`, outside the layers, is split over pp"
    no_pp = {k: (P(None, *tuple(s)[1:]) if k in stacked else s) for k, s in param_specs.items()}
    at_use = layerwise.use_plan(graph, no_pp, {k: n for k in stacked})
    if stacked - at_use:
        return None, f"`{sorted(stacked - at_use)[0]}` is read by more than one op"
    return Layout(stages, data_axes, frozenset(stacked), _reads(pre), _reads(post)), ""


def _unsplit(graph) -> str:
    """Why a model does not cut into the pieces below, or "" where it does."""
    if graph.losses:
        return "a model with loss entries"
    parts = _split_body(graph.body)
    if parts is None:
        return "the model body has not exactly one `repeat`"
    if parts[1].attrs.get("axis") is None or parts[1].attrs.get("grad") == "last":
        return "the `repeat` is not a stack of layers differentiated through"
    return ""


def splits(graph) -> bool:
    """Whether a language model's body is pre ops | one stacked `repeat` | post ops (the pieces below)."""
    return not _unsplit(graph)


def pieces(prog, ctx, n: int | None = None):
    """(embed(p, tokens) -> x, layers(p, x) -> y, head(p, y, targets, mask) -> (loss sum, count)): the model cut
    at its repeat (of `n` layers where given: a stage's), each evaluated under `ctx`. Deterministic mode computes a
    canonical shard's loss as fenced(embed) | layers | fenced(head) on one device and every mesh
    (`Deterministic.shard_sums`), as the pipeline's stages do, so that the stages' programs and one device's
    round alike: with the ends inside the whole-model program, XLA fused bf16 values across them differently and
    a pp mesh in bf16 was one device's bits for a step or two, not five (fp32: the same bits either way)."""
    body = prog.graph.body
    pre, rep, post = _split_body(body)
    if n is not None:
        rep = dataclasses.replace(rep, attrs={**rep.attrs, "n": n})
    pre_region = Region(list(body.args), list(pre), list(rep.values))
    post_region = Region(list(rep.results), list(post), list(body.outputs))

    def embed(p, tokens):
        return eval_region(pre_region, [tokens], p, ctx)[0][0]

    def layers(p, x):
        return eval_repeat(rep, [x], p, ctx, None, prog.options.remat)[0][0]

    def head(p, y, targets, mask):
        from tessera.lower.shard.deterministic import token_sum

        (logits,), _ = eval_region(post_region, [y], p, ctx)
        # the fenced head's forward hands its backward the logits as the unembedding made them (bf16) and two fp32
        # numbers a token, not the loss's fp32 exponentials (GPT-OSS-20B: 3.3 GB a canonical shard): the loss's own
        # gradient rule (reference/losses.py; rematerialised here before, its reductions ran twice a shard)
        per_token = token_cross_entropy(logits, targets)
        w = jnp.ones_like(per_token) if mask is None else mask.astype(per_token.dtype)
        return token_sum(per_token * w), jnp.sum(w)

    embed.reads, head.reads = _reads(pre), _reads(post)
    return embed, layers, head


def only(params: dict, reads: frozenset) -> dict:
    """The parameters (and their amax histories) a piece reads: what a fenced piece takes as operands."""
    return {k: v for k, v in params.items() if k.split(fp8_delayed.HISTORY)[0] in reads}


def from_stage(x, here):
    """On every stage, x's bits from the stage where `here` holds (one contributor, summed as integers: exact)."""
    from tessera.lower.shard.collectives import from_owner

    return from_owner(x, here, PP)


def pipelined_grads(det, layout: Layout, params: dict, history, batch: dict, c: int, ls, narrow: dict, tensor=None):
    """`Deterministic._per_layer_grads`' results (this device's gradient blocks summed over all C shards; per-shard
    loss sums and counts in canonical order; no terms; delayed fp8 scaling's amaxes, [1, *history] each: their max
    over the C shards) by the 1F1B schedule over the pp stages. Inside the train step's shard_map. `history`: the
    amax histories (replicated; a stacked weight's [L, 3, H] sliced to the stage's layers like the weight), or
    None. `tensor` (det_tensor.Layout): tp and/or ep split each stage's layers' compute too (their devices then run
    the same shards, no data axes; the ends are computed alike on them, each keeping its block of their gradients)."""
    from tessera.lower import precast
    from tessera.lower.shard import det_tensor
    from tessera.lower.shard.collectives import gather_full
    from tessera.lower.fence import fenced
    from tessera.lower.shard.deterministic import tree_sum

    prog, specs, sizes = det.prog, det.param_specs, dict(det.mesh.shape)
    S = layout.stages
    D = tuple(a for a in layout.data_axes if tensor is None or a not in tensor.groups)
    n_d = math.prod(sizes[a] for a in D)
    m = c // n_d
    stage = jax.lax.axis_index(PP)
    first, last = stage == 0, stage == S - 1
    stacked = layout.stacked
    ends = [k for k in params if k not in stacked]
    tied = sorted(layout.pre_reads & layout.post_reads)
    cast = precast.cast(params, narrow)

    hooks = None
    if D or tensor is not None:
        gather = det_tensor.gathers(det, tensor, D)
        hooks = {k: (lambda held, k=k: gather(k, held)) for k in stacked}
    unroll = det.unrolls(c)  # each stage's layers unrolled over weights split once here (layerwise.py)
    ctx = prog.lower_ctx(mode="train", param_use=hooks, layer_remat=layerwise.saveable_but_gathers if hooks else None,
                         unroll=unroll, **det_tensor.device_chunks(tensor))
    local_n = _split_body(prog.graph.body)[1].attrs["n"] // S
    embed, run_layers, head = pieces(prog, ctx, local_n)

    def layers(blocks, x):  # blocks: held blocks on a mesh with data axes, else the parameters as read (and the
        # stage's amax histories beside them, read as they are)
        held = {k: layerwise.held(v, layer_cast[k] if k in narrow else None) if k in stacked else v
                for k, v in blocks.items()} if hooks else blocks
        return run_layers(held, x)

    # this data device's shards of the batch: j·n_d + d for j < m, [m, rows, ...] per leaf
    d = block_index(D) if D else 0
    every = tuple(a for a, size in sizes.items() if size > 1)

    def mine(a):
        whole = jax.lax.all_gather(a, every, axis=0, tiled=True)
        return jax.lax.dynamic_index_in_dim(whole.reshape((m, n_d, -1) + a.shape[1:]), d, axis=1, keepdims=False)

    shards = {k: mine(v) for k, v in batch.items() if v is not None}
    tokens, targets, mask = shards["tokens"], shards["targets"], shards.get("mask")

    whole_ends = {k: gather_full(cast[k] if k in narrow else params[k], specs[k]) for k in ends}
    # differentiated at the held blocks through the gathers' VJPs; without data axes at the narrow copies, as one
    # device's step is (widened at the store)
    layer_blocks = {k: (params[k] if hooks else cast[k]) for k in stacked}
    layer_cast = {k: cast[k] for k in stacked}
    if unroll:
        layer_blocks, layer_cast = (layerwise.split(t, dict.fromkeys(stacked, local_n))
                                    for t in (layer_blocks, layer_cast))
    # delayed fp8 scaling: each history beside its weight (a stacked one's rows of this stage's layers); its
    # cotangent, a shard's amaxes, is max-combined over the shards (exact, in any order)
    history = history or {}
    weight_of = lambda h: h[:-len(fp8_delayed.HISTORY)]  # noqa: E731
    h_stacked = {h: jax.lax.dynamic_slice_in_dim(v, stage * local_n, local_n, axis=0)
                 for h, v in history.items() if weight_of(h) in stacked}
    h_ends = {h: v for h, v in history.items() if weight_of(h) not in stacked}
    layer_blocks.update(h_stacked)
    whole_ends = {**whole_ends, **h_ends}
    wide = {k: params[k].dtype for k in params}
    up = [(j, j + 1) for j in range(S - 1)]
    down = [(j + 1, j) for j in range(S - 1)]
    k_slots = min(m, 2 * S - 1)
    scale = jnp.ones((), jnp.float32) if ls is None else ls.scale

    def pick(a, j):
        return jax.lax.dynamic_index_in_dim(a, j, keepdims=False)

    def tick(carry, t):
        recv_f, recv_b, stash, acc, sums, counts, ring, seen = carry
        f, b = t - stage, t - 2 * (S - 1) + stage
        ok_f, ok_b = (f >= 0) & (f < m), (b >= 0) & (b < m)
        f, b = jnp.clip(f, 0, m - 1), jnp.clip(b, 0, m - 1)
        # forward of shard f: its input (the embedding, on stage 0 only) stashed, the stage's output sent up
        x_in = jnp.where(first, fenced(embed, whole_ends, pick(tokens, f), when=first), recv_f)
        slot = f % k_slots
        stash = stash.at[slot].set(jnp.where(ok_f, x_in, stash[slot]))
        y = layers(layer_blocks, x_in)

        # backward of shard b, the stage recomputed from its stashed input. Its output's cotangent is the head's
        # (on the last stage, from the loss's cotangent: the loss scale) or the next stage's input cotangent, one or
        # the other (a select, as one device's layers get the head's alone); the head and the embedding run on
        # their own stages only
        y_b, pull_l = jax.vjp(layers, layer_blocks, stash[b % k_slots])
        tgt, msk = pick(targets, b), None if mask is None else pick(mask, b)
        (s, cnt), pull_h = jax.vjp(lambda p, yy: fenced(head, p, yy, tgt, msk, when=last), whole_ends, y_b)
        g_head, g_y = pull_h((jnp.where(last, scale, 0.0).astype(s.dtype), jnp.zeros_like(cnt)))
        g_blocks, gx = pull_l(jnp.where(last, g_y, recv_b))
        _, pull_e = jax.vjp(lambda p: fenced(embed, p, pick(tokens, b), when=first), whole_ends)
        (g_embed,) = pull_e(gx)

        # a tied table: the last stage's head-side cotangent of the shard whose backward it ran this tick, kept on
        # stage 0 until that shard's backward reaches it, then the two uses summed (head side first)
        if tied and S > 1:
            j_last = jnp.clip(t - (S - 1), 0, m - 1)
            sent = {k: jax.lax.ppermute(g_head[k], PP, [(S - 1, 0)]) for k in tied}
            ring = {k: ring[k].at[j_last % S].set(jnp.where(first, sent[k], ring[k][j_last % S])) for k in tied}
            head_side = {k: ring[k][b % S] for k in tied}
        else:
            head_side = {k: g_head[k] for k in tied}
        amax = {h: g_blocks.pop(h) for h in h_stacked}
        amax.update({h: jnp.where(first if weight_of(h) in layout.pre_reads else last,
                                  g_embed[h] if weight_of(h) in layout.pre_reads else g_head[h], 0.0) for h in h_ends})
        seen = {h: jnp.where(ok_b, jnp.maximum(seen[h], amax[h]), seen[h]) for h in seen}
        leaf = {k: layerwise.restack(g) for k, g in g_blocks.items()}
        for k in ends:
            g = head_side[k] + g_embed[k] if k in tied else (g_embed[k] if k in layout.pre_reads else g_head[k])
            g, spec = layerwise.own_block(g, specs[k], tensor.whole.get(k, ()) if tensor else ())
            leaf[k] = layerwise.block_sum(g, spec, D, sizes, wide[k])
        acc = {k: acc[k].at[b].set(jnp.where(ok_b, leaf[k].astype(wide[k]), acc[k][b])) for k in acc}
        s = s * scale if ls is not None else s  # the scaled loss, as `Deterministic._per_layer_grads` returns it
        sums = sums.at[b].set(jnp.where(ok_b, s.astype(sums.dtype), sums[b]))
        counts = counts.at[b].set(jnp.where(ok_b, cnt.astype(counts.dtype), counts[b]))
        if S > 1:
            recv_f, recv_b = jax.lax.ppermute(y, PP, up), jax.lax.ppermute(gx, PP, down)
        return (recv_f, recv_b, stash, acc, sums, counts, ring, seen), None

    x0 = jax.eval_shape(embed, whole_ends, pick(tokens, 0))
    zeros = jnp.zeros(x0.shape, x0.dtype)
    loss_shape = jax.eval_shape(lambda: head(whole_ends, zeros, pick(targets, 0),
                                             None if mask is None else pick(mask, 0)))
    acc0 = {k: jnp.zeros((m,) + params[k].shape, wide[k]) for k in params}
    ring0 = {k: jnp.zeros((S,) + whole_ends[k].shape, whole_ends[k].dtype) for k in tied} if S > 1 else {}
    init = (zeros, zeros, jnp.zeros((k_slots,) + x0.shape, x0.dtype), acc0,
            jnp.zeros((m,), loss_shape[0].dtype), jnp.zeros((m,), loss_shape[1].dtype), ring0,
            {h: jnp.zeros_like(v) for h, v in {**h_stacked, **h_ends}.items()})
    (_, _, _, acc, sums, counts, _, seen), _ = jax.lax.scan(tick, init, jnp.arange(m + 2 * (S - 1)))

    grads = {k: tree_sum(a) for k, a in acc.items()}
    home = {k: first if k in layout.pre_reads else last for k in ends}  # a tied table: stage 0's sum
    grads = {k: (g if k in stacked else from_stage(g, home[k])) for k, g in grads.items()}
    sums, counts = from_stage(sums, last), from_stage(counts, last)
    if D:
        sums, counts = (layerwise.canonical_order(jax.lax.all_gather(a, D, axis=0, tiled=True), n_d, m)
                        for a in (sums, counts))
    amaxes = None
    if history:
        seen = {h: jax.lax.pmax(v, D) if D else v for h, v in seen.items()}  # over the data devices: exact
        amaxes = {h: (jax.lax.all_gather(v, PP, axis=0, tiled=True) if h in h_stacked
                      else from_stage(v, first if weight_of(h) in layout.pre_reads else last))[None]
                  for h, v in seen.items()}
    return grads, sums, counts, {}, amaxes
