"""A program's functions under `shard_map` (fast mode: psum / psum_scatter / all_gather as chosen).

`ShardPlan` holds the mesh, the rules, each parameter's PartitionSpec and the shard environment the
lowerings read. The loss runs inside `shard_map` and is differentiated from outside: the transposes of
the collectives are the gradient collectives (FSDP's all_gather → reduce-scatter, the implicit
broadcast of replicated parameters over dp → psum).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from tessera.lower import storage
from tessera.lower.options import CompileOptions
from tessera.lower.shard.collectives import ShardEnv, vocab_cross_entropy_sums
from tessera.lower.shard.expert import step_count
from tessera.lower.shard.context import check_context, context_axes, token_spec
from tessera.lower.shard.mesh import build_mesh
from tessera.lower.shard.rules import AxisRules, annotated_axes, spec_of


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """The mesh, the shard environment, and a PartitionSpec per parameter path."""

    mesh: Any
    env: ShardEnv
    param_specs: dict

    @property
    def rules(self) -> AxisRules:
        return self.env.rules

    def param_shardings(self) -> dict:
        """NamedSharding per parameter path (where init and checkpoints place them)."""
        return {k: NamedSharding(self.mesh, s) for k, s in self.param_specs.items()}

    def collectives(self, schedule: str = "gpipe") -> list[str]:
        """The collectives the lowerings emit on this mesh (pipelines on `schedule`), for the manifest."""
        r, out = self.rules, []
        data = [a for a in r.axes("batch")] + list(context_axes(r))  # params are replicated over sp too
        if data:
            out.append(f"psum(grads over {'*'.join(data)})")
        if context_axes(r):
            out.append(f"all_gather(k, v over {'*'.join(context_axes(r))})")
        if any(a in ("fsdp",) for _, axes in r.rules for a in axes):
            out.append("all_gather(params over fsdp) / reduce_scatter(grads)")
        for logical in ("heads", "mlp", "vocab"):
            if r.axes(logical):
                verb = "psum_scatter" if r.sequence_parallel and logical != "vocab" else "psum"
                out.append(f"{verb}({logical} partials over {'*'.join(r.axes(logical))})")
        if r.sequence_parallel and r.axes("heads"):
            out.append(f"all_gather(seq over {'*'.join(r.axes('heads'))})")
        if r.axes("experts"):
            out.append(f"all_to_all(expert dispatch and return over {'*'.join(r.axes('experts'))})")
            same = [a for a in r.axes("experts") if a not in r.axes("batch")]  # tokens alike: 1/ep each, gathered
            if same:
                out.append(f"all_gather(expert outputs over {'*'.join(same)})")
        if r.axes("layers") and schedule == "1f1b":
            out.append("ppermute(activations forward, input grads back between pipeline stages over pp: 1F1B)")
            out.append("psum(stage grads over the data axes and pp, once per step)")
        elif r.axes("layers"):
            out.append("ppermute(activations between pipeline stages over pp)")
        return out


def make_plan(options: CompileOptions, graph, devices=None) -> ShardPlan:
    """The plan of the options' mesh over the devices; mesh errors are TesseraErrors raised here, before
    compiling."""
    mesh = build_mesh(options, storage.held_params(options, graph), devices)  # what is split: params as held
    rules = options.rules
    if not options.deterministic:
        check_context(options)
    if options.deterministic and options.batch is not None:
        from tessera.lower.shard.deterministic import check_canonical
        check_canonical(options, options.batch, mesh.size)
    if options.pp > 1 and not options.deterministic:
        from tessera.lower.shard.pipeline import check_stages
        check_stages(options, graph)
    dims = tuple((path, p.type.names) for path, p in graph.params.items())
    axes = {path: annotated_axes(p.type) for path, p in graph.params.items()}  # as `--after shard` prints
    _check_annotations(graph, rules, axes)
    specs = {path: spec_of(a) for path, a in axes.items()}
    return ShardPlan(mesh, ShardEnv(rules, dims, options.expert_capacity, tuple(axes.items())), specs)


def _check_annotations(graph, rules: AxisRules, axes: dict) -> None:
    """Each parameter's annotated mesh axes divide its dims, and agree with the rules on every logical axis the
    activations are split along too (heads, mlp, vocab, experts, layers: the ops compute on those blocks).
    Elsewhere (embed, head_dim: ZeRO splits, gathered before use) an annotation may differ from the rules."""
    sizes = dict(rules.sizes)
    for path, p in graph.params.items():
        for dim, got, want in zip(p.type.dims, axes[path], rules.dims(p.type.names)):
            ways = math.prod(sizes[a] for a in got)
            if dim.size % ways:
                raise ValueError(f"@{path}: `{dim.name}` = {dim.size} is annotated `{'*'.join(got)}`, "
                                 f"{ways} ways, which does not divide it")
            if got != want and rules.dims((dim.name,), activation=True)[0]:
                raise ValueError(f"@{path}: `{dim.name}` is annotated `{'*'.join(got) or '-'}`, but activations "
                                 f"split `{dim.name}` by `{'*'.join(want) or '-'}` (parallel.rules); only dims "
                                 "activations keep whole (embed, head_dim) may be placed otherwise")


def batch_specs(plan: ShardPlan, batch: dict) -> dict:
    """tokens, targets, mask [batch, seq]: batch over the batch axes, seq over sp (context parallel)."""
    return {k: token_spec(plan.rules, jnp.ndim(v)) for k, v in batch.items()}


def _logits(prog, plan: ShardPlan, params, tokens, mode: str, aux: dict | None = None):
    """(logits, is-last-stage or None): through the pipeline stages when pp > 1; counters into `aux` (no pp)."""
    if dict(plan.rules.sizes).get("pp", 1) == 1:
        return prog.logits(params, tokens, mode, shard=plan.env, aux=aux), None
    from tessera.lower.shard.pipeline import pipeline_logits
    ctx = prog.lower_ctx(mode=mode, shard=plan.env)
    return pipeline_logits(prog, plan.env, params, tokens, prog.options.pipeline_microbatches, ctx)


def sharded_loss(prog, plan: ShardPlan, counted: bool = False):
    """loss(params, batch) -> fp32 scalar: the mean next-token loss, computed under shard_map.

    counted: (loss, {counter: int32}) instead, the step's counters (moe_dropped) summed over layers and devices;
    none are collected through a pipeline (pp > 1), where the MoE capacity does not apply either.
    """
    if counted and dict(plan.rules.sizes).get("pp", 1) > 1:
        plain = sharded_loss(prog, plan)
        return lambda params, batch: (plain(params, batch), {})

    def local(params, batch):
        aux = {} if counted else None
        logits, last = _logits(prog, plan, params, batch["tokens"], "train", aux)
        total, count = vocab_cross_entropy_sums(plan.env, logits, batch["targets"], batch.get("mask"))
        axes = plan.rules.axes("batch") + context_axes(plan.rules)
        if last is not None:  # pipeline: the last stage's sums count, the others' are zeros
            total, count = jnp.where(last, total, 0.0), jnp.where(last, count, 0.0)
            axes = axes + ("pp",)
        if axes:
            total, count = jax.lax.psum(total, axes), jax.lax.psum(count, axes)
        loss = total / jnp.maximum(count, 1.0)
        return loss if aux is None else (loss, {k: step_count(plan.env, v) for k, v in aux.items()})

    def loss(params, batch):
        fn = jax.shard_map(local, mesh=plan.mesh, in_specs=(plan.param_specs, batch_specs(plan, batch)),
                           out_specs=P())
        return fn(params, batch)

    if dict(plan.rules.sizes).get("pp", 1) > 1 and prog.options.pipeline_schedule == "1f1b":
        from tessera.lower.shard.pipeline_1f1b import with_1f1b_grads
        return with_1f1b_grads(prog, plan, loss)  # gradients from the 1F1B schedule; the value alone: GPipe
    return loss


def sharded_forward(prog, plan: ShardPlan, mode: str):
    """forward(params, tokens) -> logits [batch, seq, vocab] computed under shard_map (seq split over sp when
    the split divides the tokens' length; otherwise sp replicates the work)."""

    def forward(params, tokens):
        seq_split = plan.rules.dims(("batch", "seq"), activation=True)[1]
        use = plan if tokens.shape[1] % plan.rules.size(seq_split) == 0 else \
            dataclasses.replace(plan, env=plan.env.whole_seq())

        def local(p, t):
            logits, last = _logits(prog, use, p, t, mode)
            return logits if last is None else jax.lax.psum(jnp.where(last, logits, 0.0), "pp")

        out = P(*token_spec(use.rules), use.rules.axes("vocab") or None)  # [batch, seq / sp, vocab / tp]
        fn = jax.shard_map(local, mesh=plan.mesh, in_specs=(plan.param_specs, token_spec(use.rules)), out_specs=out)
        return fn(params, tokens)

    return forward


def sharded_generate(plan: ShardPlan, run, batch: int, specs: dict | None = None):
    """run(params, prompts, seed, max_new, shard) under shard_map: prompts split over the batch axes when they divide
    the batch, KV caches holding this device's kv_heads, logits gathered over vocab before sampling.
    specs: the parameters' PartitionSpecs in their layout (`Program.param_specs`), default the stacked ones."""
    specs = specs or plan.param_specs
    env = plan.env.whole_seq()  # sp replicates the decode: every sp device runs the whole prompt
    axes = plan.rules.axes("batch")
    spec = P(axes or None, None) if axes and batch % plan.rules.size(axes) == 0 else P()

    def whole_layers(p):  # generation runs every layer on every stage: gather the pp split (exact)
        if dict(plan.rules.sizes).get("pp", 1) == 1:
            return p
        return {k: (jax.lax.all_gather(v, "pp", axis=0, tiled=True)
                    if not isinstance(v, list) and tuple(plan.param_specs[k])[:1] == ("pp",) else v)
                for k, v in p.items()}  # a split parameter's layers are each whole over pp already
    # (a PartitionSpec's slice is a plain tuple, which never equals a PartitionSpec: compare tuples)

    def generate(params, prompts, seed, max_new):
        fn = jax.shard_map(lambda p, x, s, n: run(whole_layers(p), x, s, n, env), mesh=plan.mesh,
                           in_specs=(specs, spec, P(), P()), out_specs=spec, check_vma=False)
        return fn(params, prompts, seed, max_new)

    return generate
