"""Can a pipeline stage's per-shard gradient be bitwise one device's? The question under deterministic pp
(issue 36, item 2; docs/parallel.md, "Planned next").

One canonical shard of a language model, its parameters' gradient computed three ways in one process on one CPU
device, compared bit for bit:

- "whole":  `jax.value_and_grad` of the model's summed token loss, as `Deterministic._shard_sums` computes it;
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
from tessera.lower.shard.deterministic import fenced
from tessera.lower.shard.pipeline import split_body


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
    stacked = {path for path, t in prog.graph.params.items() if path.startswith(rep.scope_name + "/")}

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


def chained(prog, stages: int, fence: bool):
    """(params, tokens, targets) -> (loss, grads): the pieces' VJPs chained by hand, each piece fenced or not."""
    embed, runs, head_loss = pieces(prog, stages)
    wrap = (lambda f: (lambda *a: fenced(f, *a))) if fence else (lambda f: f)

    def vjp(f, *args):
        return jax.vjp(wrap(f), *args)

    def value_and_grad(p, tokens, targets):
        x, pull_e = vjp(embed, p, tokens)
        pulls = []
        for run in runs:
            x, pull = vjp(run, p, x)
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
    f = lambda g: (lambda *a: fenced(g, *a))  # noqa: E731
    mesh = Mesh(np.asarray(devices[:stages]), ("pp",))
    stacked = {path for path in prog.graph.params if path.startswith(split_body(prog.graph.body)[1].scope_name + "/")}
    up = [(j, j + 1) for j in range(stages - 1)]
    down = [(j + 1, j) for j in range(stages - 1)]

    def local(p, tokens, targets):
        stage = jax.lax.axis_index("pp")
        h = f(embed)(p, tokens)
        x = h
        for s in range(stages - 1):  # hop s: stage s's output reaches stage s + 1
            sent = jax.lax.ppermute(f(layers_here)(p, x), "pp", up)
            x = jnp.where(stage == s + 1, sent, x)
        y, pull_l = jax.vjp(f(layers_here), p, x)
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


def main(argv=None) -> int:
    from tessera.lower.program import compile_experiment
    from tessera.spec import load_experiment

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="specs/llama_tiny.yaml")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args(argv)
    exp = load_experiment(args.spec, args.set)
    prog = compile_experiment(exp)
    params = prog.init(0)
    b, s = 2, int(exp.task.seq_len)
    rng = np.random.default_rng(0)
    vocab = int(prog.graph.params[next(k for k in prog.graph.params if "embed" in k)].type.dims[0].size)
    tokens = jnp.asarray(rng.integers(0, vocab, (b, s)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, vocab, (b, s)), jnp.int32)
    ways = {"whole": whole(prog), "chained": chained(prog, 1, False),
            f"staged x{args.stages}": chained(prog, args.stages, False),
            f"fenced x{args.stages}": chained(prog, args.stages, True), "fenced x1": chained(prog, 1, True)}
    if len(jax.devices()) >= args.stages > 1:  # XLA_FLAGS=--xla_force_host_platform_device_count=N on the CPU
        ways[f"mesh pp={args.stages}"] = on_mesh(prog, args.stages, jax.devices())
    out = {name: jax.jit(fn)(params, tokens, targets) for name, fn in ways.items()}
    for against in ("whole", "fenced x1"):  # one device as it runs today, and as it would run fenced pieces
        ref_loss, ref = out[against]
        for name, (loss, grads) in out.items():
            if name == against:
                continue
            differ = [k for k in ref if not np.array_equal(np.asarray(grads[k]).view(np.uint32),
                                                           np.asarray(ref[k].astype(jnp.float32)).view(np.uint32))]
            worst = max((float(jnp.max(jnp.abs(grads[k] - ref[k]))) / float(jnp.max(jnp.abs(ref[k])) + 1e-30)
                         for k in differ), default=0.0)
            print(f"{name:<12} vs {against:<9}: loss {'=' if loss == ref_loss else '!='}, {len(differ)} of {len(ref)} "
                  f"gradients differ (worst {worst:.1e}) {differ[:3]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
