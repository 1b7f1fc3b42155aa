"""Can a pipeline stage's per-shard gradient be bitwise one device's? The question under deterministic pp
(issue 36, item 2). The answer is built since session 33: tessera/lower/shard/det_pipeline.py (docs/parallel.md,
"Deterministic pp"); this prototype stays as the record of how the cut was found.

One canonical shard of a language model, its parameters' gradient computed three ways in one process on one CPU
device, compared bit for bit:

- "whole":  `jax.value_and_grad` of the model's summed token loss, as `Deterministic.shard_sums` computes it;
- "chained": the model as pre ops | the repeat's layers | post ops + loss, the three pieces' VJPs chained by hand
             (the structure every pipeline stage runs), all layers in one piece;
- "staged":  the same with the layers cut in `stages` pieces (what pp stages would hold), chained in one program;
- "fenced":  "staged" with every piece a computation of its own (`deterministic.fenced`), as stages on different
             devices would compile them.

    python -m bench.experiments.det_pipeline [--spec specs/llama_tiny.yaml] [--stages 2] [--set KEY=VALUE]

Measured (session 32, this machine's CPU, under `tessera run`'s deterministic flags: PJRT_NPROC=256, XLA_FLAGS
`--xla_disable_hlo_passes=tree_reduction_rewriter`; two sequences of the spec's length, gradients compared bit for
bit with "whole" and with "fenced x1", one device as it would run fenced pieces):

| model (layers), stages | chained | staged | fenced xS vs fenced x1 |
|---|---|---|---|
| llama_tiny (2), 2 | = | = | = |
| llama_tiny (8), 2 and 4 | = | = | = |
| llama_tiny (4), 4 (one layer a stage) | = | = | = |
| gpt_oss_tiny (4), 2 (one scan step a stage: period 2) | = | all 22 differ (9e-7) | `sinks` differs (1e-7) |
| gpt_oss_tiny (8), 2; (12), 3; (16), 4 (2+ scan steps a stage) | = | = | = |

So the pieces chained by hand give the whole model's gradients bitwise, and fenced pieces give one device's fenced
bits whatever the stage cut, once every stage's layer scan runs at least two steps (a loop of one step is inlined
and fused with its surroundings, as the shard loop's was: `opaque_map`). The fenced head's loss value differed from
"whole" (gpt_oss_tiny 16 layers) but not between fenced cuts.

"mesh pp=S" (`on_mesh`, with `--xla_force_host_platform_device_count` >= S): stage s's layers on device s of a `pp`
mesh, activations and cotangents passed by `ppermute`. Against "fenced x1", same flags, 4 host devices: loss and all
gradients bitwise equal for llama_tiny (2 layers, pp=2; 8 layers, pp=4) and gpt_oss_tiny (8 layers, pp=2; 16, pp=4);
gpt_oss_tiny at 4 layers, pp=2 (one scan step a stage) differs in `sinks` (1.2e-7), as in one process. Not yet
tried: a tick schedule (GPipe or 1F1B over the canonical shards, not every stage re-running at every hop as this
probe does) and the shards' gradients folded in the canonical tree across ticks.

`--ticks` (`ticks`, `ticks_value_and_grad`): the 1F1B lockstep over m canonical shards, every piece fenced, each
shard's gradient of each piece folded into that piece's `tree_sum` tree as the shard's B tick comes (idle ticks fold
nothing), the pieces' sums added in one order at the end; one device runs the same program with one stage. Same
flags, 4 host devices, loss sum and every gradient bitwise one device's: llama_tiny (2 layers, pp=2, 4 shards; 8
layers, pp=4, 8 shards), gpt_oss_tiny (8 layers, pp=2, 4 shards; 16 layers, pp=4, 8 shards); gpt_oss_tiny at 4
layers, pp=2 again off in `sinks` (6e-8). Against today's shard loop (each shard's whole-model gradient, stacked,
tree-summed) the last bits differed (<= 8e-7), but that reference ran each shard eagerly: against today's loop as
`Deterministic` runs it on one device (one jitted program, an opaque loop, `tree_sum`) the one-stage schedule is
bitwise equal for gpt_oss_tiny (8 layers) and differs only in llama_tiny's tied `embed/table`, whose two uses the
schedule folds in two trees; with `--tied-order` (one device folding each shard's whole gradient, the table's uses
summed first) it is bitwise equal there too. So the schedule need not change one device's numbers. On a pp mesh
`--tied-order` sends each shard's head-side table gradient from the last stage to stage 0 (`ppermute`, a ring of S
shards' on stage 0) to be summed before stage 0's fold: the pp mesh, the one-stage schedule and today's loop then
agree bit for bit (llama_tiny pp=2 and pp=4 with 8 layers; gpt_oss_tiny 8 layers pp=2).

`--fence ends` leaves the layers' runs unfenced (fences on the embedding and the head only): a fenced piece holding
the per-layer gathers' collectives crashed XLA:CPU on a pp mesh (docs/parallel.md), and with the ends alone fenced
today's deterministic step kept its bits on every mesh tried. The tick schedule with `--fence ends`: bitwise one
device's on the same configurations (gpt_oss_tiny 8 layers pp=2, 16 layers pp=4; llama_tiny 2 layers pp=2); the
one-step case (gpt_oss_tiny 4 layers, pp=2) now differs in all 22 gradients (1.2e-6).

    XLA_FLAGS="--xla_disable_hlo_passes=tree_reduction_rewriter --xla_force_host_platform_device_count=4" \
      PJRT_NPROC=256 python -m bench.experiments.det_pipeline --ticks --stages 2 --shards 4
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tessera.ir.types import Region
from tessera.lower.interpret import eval_region, eval_repeat
from tessera.lower.reference.losses import token_cross_entropy
from tessera.lower.fence import fenced
from tessera.lower.shard.pipeline import split_body


def stacked_paths(prog) -> set[str]:
    """The parameters stacked along the repeat's layers (its scope's)."""
    rep = split_body(prog.graph.body)[1]
    return {path for path in prog.graph.params if path.startswith(rep.scope_name + "/")}


def piece_params(prog) -> tuple[set[str], set[str]]:
    """(the params the pre ops read, the params the post ops read): a tied table is in both."""
    from tessera.ir.types import ParamRef

    pre, _, post = split_body(prog.graph.body)
    reads = lambda ops: {o.path for op in ops for o in op.operands if isinstance(o, ParamRef)}  # noqa: E731
    return reads(pre), reads(post)


def pieces(prog, stages: int):
    """(embed, [layers of each stage], head_loss): the model's pre ops, its repeat cut in `stages` runs of layers
    (each taking the params with the stacked ones sliced to its layers), and its post ops with the summed loss."""
    body = prog.graph.body
    pre, rep, post = split_body(body)
    ctx = prog.lower_ctx(mode="train")
    n = rep.attrs["n"] // stages
    rep_local = dataclasses.replace(rep, attrs={**rep.attrs, "n": n})
    pre_region = Region(list(body.args), list(pre), list(rep.values))
    post_region = Region(list(rep.results), list(post), list(body.outputs))
    stacked = stacked_paths(prog)

    def embed(p, tokens):
        return eval_region(pre_region, [tokens], p, ctx)[0][0]

    def layers(s):
        def run(p, x):
            mine = {k: (v[s * n:(s + 1) * n] if k in stacked else v) for k, v in p.items()}
            return eval_repeat(rep_local, [x], mine, ctx, None, prog.options.remat)[0][0]
        return run

    def head_loss(p, y, targets):
        (logits,), _ = eval_region(post_region, [y], p, ctx)
        return jnp.sum(token_cross_entropy(logits, targets))

    return embed, [layers(s) for s in range(stages)], head_loss


TIED_ORDER = ""  # --tied-order: one device folds each shard's whole gradient, its tied uses summed in this order
FENCE_LAYERS = True  # --fence ends: the layers' runs unfenced (collectives inside a fenced piece crashed XLA:CPU)


def _fences(fence: bool):
    """(wrap of the embedding and head pieces, wrap of the layers' runs)."""
    on = lambda f: (lambda *a: fenced(f, *a))  # noqa: E731
    off = lambda f: f  # noqa: E731
    return (on if fence else off), (on if fence and FENCE_LAYERS else off)


def chained(prog, stages: int, fence: bool):
    """(params, tokens, targets) -> (loss, grads): the pieces' VJPs chained by hand, each piece fenced or not."""
    embed, runs, head_loss = pieces(prog, stages)
    wrap, wrap_layers = _fences(fence)

    def vjp(f, *args, layers=False):
        return jax.vjp((wrap_layers if layers else wrap)(f), *args)

    def value_and_grad(p, tokens, targets):
        x, pull_e = vjp(embed, p, tokens)
        pulls = []
        for run in runs:
            x, pull = vjp(run, p, x, layers=True)
            pulls.append(pull)
        loss, pull_h = vjp(lambda q, y: head_loss(q, y, targets), p, x)
        grads = []
        gp, gy = pull_h(jnp.ones_like(loss))
        grads.append(gp)
        for pull in reversed(pulls):
            gp, gy = pull(gy)
            grads.append(gp)
        gp, _ = pull_e(gy)
        grads.append(gp)
        # each piece's gradient of a parameter is zero outside its own use: summed in one fixed order
        total = {k: sum(g[k].astype(jnp.float32) for g in grads[1:]) + grads[0][k].astype(jnp.float32)
                 for k in p}
        return loss, total

    return value_and_grad


def on_mesh(prog, stages: int, devices):
    """(params, tokens, targets) -> (loss, grads): the fenced pieces with stage s's layers on device s of a `pp` mesh,
    activations and their cotangents passed by `ppermute`. A correctness probe, not a schedule: every device runs
    its layers at each of the S forward (and backward) hops, on its input as it stands, and the run that counts is the
    last, when every device holds its true input (exact values: `ppermute` and `where` move bits, they add nothing).
    Gradients: the layers' from each device's block, the embedding's from stage 0, the head's from stage S - 1."""
    from jax.sharding import Mesh, PartitionSpec as P

    embed, runs, head_loss = pieces(prog, stages)
    layers_here = runs[0]  # on a device, the params' stacked dim holds its own layers only: its run 0
    f, fl = _fences(True)
    mesh = Mesh(np.asarray(devices[:stages]), ("pp",))
    stacked = stacked_paths(prog)
    up = [(j, j + 1) for j in range(stages - 1)]
    down = [(j + 1, j) for j in range(stages - 1)]

    def local(p, tokens, targets):
        stage = jax.lax.axis_index("pp")
        h = f(embed)(p, tokens)
        x = h
        for s in range(stages - 1):  # hop s: stage s's output reaches stage s + 1
            sent = jax.lax.ppermute(fl(layers_here)(p, x), "pp", up)
            x = jnp.where(stage == s + 1, sent, x)
        y, pull_l = jax.vjp(fl(layers_here), p, x)
        loss, pull_h = jax.vjp(f(lambda q, y: head_loss(q, y, targets)), p, y)
        gp_h, gy = pull_h(jnp.ones_like(loss))
        g = gy
        for s in reversed(range(1, stages)):  # hop: stage s's input cotangent reaches stage s - 1
            sent = jax.lax.ppermute(pull_l(g)[1], "pp", down)
            g = jnp.where(stage == s - 1, sent, g)
        gp_l, gx = pull_l(g)
        _, pull_e = jax.vjp(f(embed), p, tokens)
        gp_e = pull_e(gx)[0]
        last, first = stage == stages - 1, stage == 0
        one = lambda v, here: jax.lax.psum(jnp.where(here, v, jnp.zeros_like(v)), "pp")  # noqa: E731 (a device's)
        grads = {}
        for k in p:
            if k in stacked:
                grads[k] = jax.lax.all_gather(gp_l[k].astype(jnp.float32), "pp", axis=0, tiled=True)
            else:
                grads[k] = (one(gp_e[k].astype(jnp.float32), first) + one(gp_h[k].astype(jnp.float32), last)
                            + one(gp_l[k].astype(jnp.float32), last))  # a piece's use: one device's bits
        return one(loss, last), grads

    def value_and_grad(p, tokens, targets):
        specs = {k: (P("pp") if k in stacked else P()) for k in p}
        fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), {k: P() for k in p}),
                           check_vma=False)
        return fn(p, tokens, targets)

    return value_and_grad


def whole(prog):
    def loss(p, tokens, targets):
        return jnp.sum(token_cross_entropy(prog.logits(p, tokens, "train"), targets))
    return jax.value_and_grad(loss)


def _setup(spec: str, sets: list, shape: tuple[int, ...]):
    """(program, params, tokens, targets) of the spec: seeded random ids of `shape`, the last dim the sequence."""
    from tessera.lower.program import compile_experiment
    from tessera.spec import load_experiment

    exp = load_experiment(spec, sets)
    prog = compile_experiment(exp)
    rng = np.random.default_rng(0)
    vocab = int(prog.graph.params[next(k for k in prog.graph.params if "embed" in k)].type.dims[0].size)
    shape = shape + (int(exp.task.seq_len),)
    ids = lambda: jnp.asarray(rng.integers(0, vocab, shape), jnp.int32)  # noqa: E731
    return prog, prog.init(0), ids(), ids()


def _differences(got, ref) -> str:
    """How (loss, grads) `got` differs from `ref`, bit for bit: the loss, how many gradients, the worst one."""
    (loss, grads), (ref_loss, ref) = got, ref
    differ = [k for k in ref if not np.array_equal(np.asarray(grads[k]).view(np.uint32),
                                                   np.asarray(ref[k].astype(jnp.float32)).view(np.uint32))]
    worst = max((float(jnp.max(jnp.abs(grads[k] - ref[k]))) / float(jnp.max(jnp.abs(ref[k])) + 1e-30)
                 for k in differ), default=0.0)
    return (f"loss {'=' if loss == ref_loss else '!='}, {len(differ)} of {len(ref)} gradients differ "
            f"(worst {worst:.1e}) {differ[:3]}")


def main(argv=None) -> int:

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="specs/llama_tiny.yaml")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--fence", choices=("all", "ends"), default="all")
    args = ap.parse_args(argv)
    global FENCE_LAYERS
    FENCE_LAYERS = args.fence == "all"
    prog, params, tokens, targets = _setup(args.spec, args.set, (2,))
    ways = {"whole": whole(prog), "chained": chained(prog, 1, False),
            f"staged x{args.stages}": chained(prog, args.stages, False),
            f"fenced x{args.stages}": chained(prog, args.stages, True), "fenced x1": chained(prog, 1, True)}
    if len(jax.devices()) >= args.stages > 1:  # XLA_FLAGS=--xla_force_host_platform_device_count=N on the CPU
        ways[f"mesh pp={args.stages}"] = on_mesh(prog, args.stages, jax.devices())
    out = {name: jax.jit(fn)(params, tokens, targets) for name, fn in ways.items()}
    for against in ("whole", "fenced x1"):  # one device as it runs today, and as it would run fenced pieces
        for name, got in out.items():
            if name != against:
                print(f"{name:<12} vs {against:<9}: {_differences(got, out[against])}", flush=True)
    return 0




# ---- a tick schedule over canonical shards, the shards' gradients folded in the canonical tree -------------------


def _fold(parts: tuple, leaf: dict, j):
    """`running_tree_sum.opaque_fold`'s step: shard j's gradients `leaf` (fp32) into the partial sums `parts` (one
    dict a level) of `tree_sum`'s tree over the shards, by j's trailing one bits."""
    levels = len(parts)

    def carry(t):
        def branch(parts, leaf):
            v = leaf
            for level in range(t):
                v = {k: parts[level][k] + v[k] for k in v}
            return tuple(v if level == t else p for level, p in enumerate(parts))
        return branch

    t = jax.lax.population_count(j ^ (j + 1)) - 1
    return jax.lax.switch(t, [carry(level) for level in range(levels)], parts, leaf)


def ticks(prog, stages: int, m: int):
    """The 1F1B lockstep (tessera/lower/shard/pipeline_1f1b.py) over m canonical shards, inside a `pp` shard_map
    (stages = 1: one device, the same program): tick t, stage s runs F of shard t - s and B of shard t - 2(S-1) + s,
    B recomputing the stage from its stashed input. Each piece is fenced; each shard's gradient of the embedding
    (stage 0) and of the stage (its layers, and the head on the last stage: one pull) is folded into that piece's
    tree as shard j arrives (an idle tick folds nothing), and the two trees' sums are added at the end (a tied table:
    the embedding's use plus the head's, on one device as on a mesh)."""
    embed, runs, head_loss = pieces(prog, stages)
    pre_reads, post_reads = piece_params(prog)
    tied = sorted(pre_reads & post_reads) if TIED_ORDER else []
    layers_here = runs[0]
    f, fl = _fences(True)
    levels = m.bit_length()
    up = [(j, j + 1) for j in range(stages - 1)]
    down = [(j + 1, j) for j in range(stages - 1)]
    k = min(m, 2 * stages - 1)

    def local(p, tokens, targets):  # tokens, targets [m, b, s]
        stage = jax.lax.axis_index("pp") if stages > 1 else 0
        first, last = stage == 0, stage == stages - 1
        wide = {q: jnp.zeros(v.shape, jnp.float32) for q, v in p.items()}
        zero_parts = tuple(dict(wide) for _ in range(levels))
        h0 = f(embed)(p, tokens[0])

        def stage_out(q, x, j):
            y = fl(layers_here)(q, x)
            return y, f(lambda q, y: head_loss(q, y, targets[j]))(q, y)

        def tick(carry, t):
            recv_f, recv_b, stash, parts, losses, tstash = carry
            m_f, m_b = t - stage, t - 2 * (stages - 1) + stage
            ok_f, ok_b = (m_f >= 0) & (m_f < m), (m_b >= 0) & (m_b < m)
            m_f, m_b = jnp.clip(m_f, 0, m - 1), jnp.clip(m_b, 0, m - 1)
            x_in = jnp.where(first, f(embed)(p, tokens[m_f]), recv_f)
            stash = stash.at[m_f % k].set(jnp.where(ok_f, x_in, stash[m_f % k]))
            y = fl(layers_here)(p, x_in)
            (_, loss), pull = jax.vjp(lambda q, x: stage_out(q, x, m_b), p, stash[m_b % k])
            gy = jnp.where(last, jnp.zeros_like(recv_b), recv_b)
            g_layers_head, gx = pull((gy, jnp.where(last, 1.0, 0.0).astype(loss.dtype)))
            _, pull_e = jax.vjp(lambda q: f(embed)(q, tokens[m_b]), p)
            g_embed = pull_e(gx)[0]
            # the layers' and the head's gradients come from one pull: split them by piece (the head's params are
            # those outside the repeat); one piece uses each parameter but a tied table (embedding and head)
            e_parts, l_parts = parts
            leaf = lambda g: {q: v.astype(jnp.float32) for q, v in g.items()}  # noqa: E731
            if TIED_ORDER:  # one leaf a shard: a tied table's two uses summed first, in that order
                head_side = leaf(g_layers_head)
                embed_side = leaf(g_embed) if stages == 1 else {q: jnp.where(first, v, 0.0) for q, v in
                                                                leaf(g_embed).items()}
                if stages > 1:  # the last stage's share of the tied table, for stage 0's fold of the same shard
                    sent = {q: jax.lax.ppermute(head_side[q], "pp", [(stages - 1, 0)]) for q in tied}
                    j_last = jnp.clip(t - (stages - 1), 0, m - 1)  # the shard the last stage's B ran this tick
                    tstash = {q: tstash[q].at[j_last % stages].set(jnp.where(first, sent[q], tstash[q][j_last % stages]))
                              for q in tied}
                    head_side = {q: (jnp.where(first, tstash[q][m_b % stages], 0.0) if q in tied else v)
                                 for q, v in head_side.items()}
                a, b = (head_side, embed_side) if TIED_ORDER == "head+embed" else (embed_side, head_side)
                both = {q: a[q] + b[q] for q in a}
                l_parts = jax.lax.cond(ok_b, lambda x: _fold(x, both, m_b), lambda x: x, l_parts)
            else:
                e_parts = jax.lax.cond(ok_b & first, lambda a: _fold(a, leaf(g_embed), m_b), lambda a: a, e_parts)
                l_parts = jax.lax.cond(ok_b, lambda a: _fold(a, leaf(g_layers_head), m_b), lambda a: a, l_parts)
            losses = losses.at[m_b].set(jnp.where(ok_b & last, loss, losses[m_b]))
            if stages > 1:
                recv_f, recv_b = jax.lax.ppermute(y, "pp", up), jax.lax.ppermute(gx, "pp", down)
            return (recv_f, recv_b, stash, (e_parts, l_parts), losses, tstash), None

        tstash0 = {q: jnp.zeros((stages,) + p[q].shape, jnp.float32) for q in tied}
        init = (jnp.zeros_like(h0), jnp.zeros_like(h0), jnp.zeros((k,) + h0.shape, h0.dtype),
                (zero_parts, zero_parts), jnp.zeros((m,), jnp.float32), tstash0)
        (_, _, _, parts, losses, _), _ = jax.lax.scan(tick, init, jnp.arange(m + 2 * (stages - 1)))
        e_sum, lh_sum = parts[0][-1], parts[1][-1]
        if stages > 1:
            e_sum = {q: jax.lax.psum(jnp.where(first, v, 0.0), "pp") for q, v in e_sum.items()}
            losses = jax.lax.psum(jnp.where(last, losses, 0.0), "pp")
        return losses, e_sum, lh_sum

    return local


def ticks_value_and_grad(prog, stages: int, m: int, devices=None):
    """(params, tokens [m, b, s], targets) -> (loss sum, grads): `ticks` on one device (stages 1) or a pp mesh."""
    from jax.sharding import Mesh, PartitionSpec as P

    from tessera.lower.shard.deterministic import tree_sum

    stacked = stacked_paths(prog)
    pre_reads = piece_params(prog)[0]
    local = ticks(prog, stages, m)

    def finish(losses, e_sum, lh_sum):
        # the layers' sums are each device's own block, the embedding's stage 0's, the rest the last stage's
        return tree_sum(losses), {q: e_sum[q] + lh_sum[q] for q in lh_sum}

    if stages == 1:
        return lambda p, tokens, targets: finish(*local(p, tokens, targets))
    mesh = Mesh(np.asarray(devices[:stages]), ("pp",))

    def value_and_grad(p, tokens, targets):
        specs = {q: (P("pp") if q in stacked else P()) for q in p}

        def body(p, tokens, targets):
            losses, e_sum, lh_sum = local(p, tokens, targets)
            stage = jax.lax.axis_index("pp")
            # a parameter outside the layers from the stage whose tree holds it: with --tied-order stage 0's for
            # those the pre ops read (the tied table's two uses were summed there), else the last stage's
            home = lambda q: 0 if TIED_ORDER and q in pre_reads else stages - 1  # noqa: E731
            whole = {q: (jax.lax.all_gather(v, "pp", axis=0, tiled=True) if q in stacked
                         else jax.lax.psum(jnp.where(stage == home(q), v, 0.0), "pp")) for q, v in lh_sum.items()}
            # the embedding's tree (stage 0's, psum'd in `ticks`) holds the layers' zeros, a block's worth
            e_whole = {q: (jax.lax.all_gather(v, "pp", axis=0, tiled=True) if q in stacked else v)
                       for q, v in e_sum.items()}
            return finish(losses, e_whole, whole)

        fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), {q: P() for q in p}),
                           check_vma=False)
        return fn(p, tokens, targets)

    return value_and_grad


def main_ticks(argv=None) -> int:
    """--ticks: the schedule over --shards canonical shards on one device against a pp mesh, bit for bit."""
    from tessera.lower.shard.deterministic import tree_sum
    from tessera.lower.shard.shard_loop import opaque_map

    ap = argparse.ArgumentParser()
    ap.add_argument("--ticks", action="store_true")
    ap.add_argument("--spec", default="specs/llama_tiny.yaml")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--fence", choices=("all", "ends"), default="all")
    ap.add_argument("--tied-order", choices=("", "head+embed", "embed+head"), default="")
    args = ap.parse_args(argv)
    global FENCE_LAYERS, TIED_ORDER
    FENCE_LAYERS, TIED_ORDER = args.fence == "all", args.tied_order
    prog, params, tokens, targets = _setup(args.spec, args.set, (args.shards, 1))
    one = jax.jit(ticks_value_and_grad(prog, 1, args.shards))(params, tokens, targets)
    mesh = jax.jit(ticks_value_and_grad(prog, args.stages, args.shards, jax.devices()))(params, tokens, targets)
    # and the shards' gradients as today's shard loop sums them (`Deterministic` on one device, in one program):
    # each shard's whole-model gradient in an opaque loop, stacked, tree-summed
    def loop(p, tokens, targets):
        losses, grads = opaque_map(lambda sh: whole(prog)(p, sh[0], sh[1]), (tokens, targets), args.shards)
        return tree_sum(losses), {q: tree_sum(g.astype(jnp.float32)) for q, g in grads.items()}

    today = jax.jit(loop)(params, tokens, targets)
    for name, got in (("pp mesh", mesh), ("today's loop", today)):
        print(f"ticks x1 vs {name:<12}: {_differences(got, one)}", flush=True)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main_ticks() if "--ticks" in sys.argv else main())
