"""Deterministic mode: the loss curve and final parameters do not depend on the mesh, bit for bit.

The batch is cut into C canonical shards (C fixed by the spec, not the mesh). Each shard's loss sum and
gradients are computed by the same function on the same shapes wherever it runs, on whole parameters (gathered
from the devices' blocks: exact, no arithmetic). The devices share the C shards between them (every mesh axis
acts as a data axis here), and the per-shard results are reduced in one fixed balanced binary tree over the C
leaves. A language model with C a power of two gathers each parameter where its layer reads it and sums the
gradients into each device's blocks as the tree goes (`_per_layer_grads`, tessera/lower/shard/layerwise.py).
Otherwise each shard runs on the whole model gathered for the step: each device sums its own shards' gradients,
an aligned subtree when C is a power of two, and the devices' subtree sums meet in `ordered_sum` (otherwise, and
for the per-shard scalars, all C are gathered).
What needs the whole gradient (the loss, the gradient's norm, whether it is finite) is computed from it alike on
every device; then each device updates only its own blocks of the parameters and optimizer state, handing the
optimizer that norm (clipping) and finiteness (loss scaling), so the optimizer state is never gathered (`fenced`
keeps the update's elementwise arithmetic the same on a block as on the whole tensor). L-BFGS, whose update is not
elementwise, gathers its state and updates the whole tensors on every device. On one device the same program runs
on a one-device mesh, so the single-device run is the reference every mesh reproduces.

A model with loss entries trained on batches of samples (burgers pairs: `Program.canonical_objective`) runs
the same way: each canonical shard's weighted objective and named terms (means over its samples, which
`tessera check` requires: ir/check_objectives.py) are tree-summed and divided by C, the mean over the batch.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from tessera.diagnostics import TesseraError
from tessera.ir.check import MAX_CANONICAL, canonical_problems, canonical_shards  # noqa: F401 (re-exported)
from tessera.lower import fp8_delayed, fp8_held, loss_scale, precast
from tessera.lower.fence import fenced
from tessera.lower.interpret import param_bindings, stacked_layers
from tessera.lower.reference.losses import token_cross_entropy
from tessera.lower.shard import det_pipeline, layerwise
from tessera.lower.shard.collectives import gather_full, local_block
from tessera.lower.shard.shard_loop import opaque_map, per_shard


def check_canonical(options, batch: int, devices: int) -> None:
    """The batch's canonical shards split evenly over the devices (a TesseraError at task.batch otherwise; `tessera
    check` runs the same rule, tessera.ir.check.check_canonical_batch)."""
    problems = canonical_problems(batch, devices, options.span, options.canonical_shards)
    if problems:
        raise TesseraError(problems)


def tree_sum(x):
    """Sum over the leading axis in a fixed balanced binary tree: ((x0+x1)+(x2+x3))+... for any leaf count."""
    while x.shape[0] > 1:
        n = x.shape[0]
        pairs = x[: n - n % 2].reshape((n // 2, 2) + x.shape[1:])
        summed = pairs[:, 0] + pairs[:, 1]
        x = jnp.concatenate([summed, x[n - 1:]], axis=0) if n % 2 else summed
    return x[0]


def token_sum(x):
    """The sum of a shard's per-token losses in `tree_sum`'s order (elementwise adds only): its bits then do not
    depend on how XLA compiles the reduction around it. `jnp.sum` gave one device's whole-model program and the
    pipelined step's fenced head (tessera/lower/shard/det_pipeline.py) loss values a last bit apart (llama_tiny,
    pp=4 x dp=2, step 4) while every gradient was the same; the gradient of this sum is the same ones."""
    return tree_sum(x.reshape(-1))


def shard_gradients(fn, local, m: int, widths: dict, history=None):
    """(loss sums, counts, terms, amaxes: each [m, ...] in loop order; gradients summed over the m shards) of
    fn(shard) = ((loss sum, (count, terms)), gradients) over this device's m shards `local`: the gradients (a list
    of them, one a layer, where the shard loop read the weights split into their layers: stacked again) stacked by
    `per_shard`, widened to `widths[path]` and tree-summed; delayed fp8's amaxes (`history`'s cotangents) stacked
    apart. (Summing two shards' gradients as they come, an fp32 sum carried through the loop, measured slower on
    one H100: bench/experiments/running_tree_sum.py's note.)"""
    (sums, (counts, terms)), grads = per_shard(fn, local, m)
    grads, amaxes = fp8_delayed.split(grads, history)
    return sums, counts, terms, amaxes, {k: layerwise.restack(layerwise.each(
        lambda x, k=k: tree_sum(x.astype(widths[k])), g)) for k, g in grads.items()}


def ordered_sum(x, axes: tuple):
    """The sum over the n devices of `axes` of each one's x, added in one fixed balanced binary tree in device
    order (tree_sum over [x of device 0, ..., x of device n-1]), on every device. Each device sends the others its
    chunks (an all-to-all), sums the n pieces of its own chunk in that tree and the summed chunks are gathered: the
    bytes of a reduce-scatter and an all-gather, where gathering every device's x would hold n of them."""
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    flat = x.reshape(-1)
    size = -(-flat.shape[0] // n)
    flat = jnp.pad(flat, (0, size * n - flat.shape[0]))
    pieces = jax.lax.all_to_all(flat.reshape(n, size), axes, 0, 0)  # row j: device j's piece of this chunk
    mine = tree_sum(pieces)
    whole = jax.lax.all_gather(mine, axes, axis=0, tiled=True)
    return whole[: math.prod(x.shape)].reshape(x.shape)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def gradient_buffers(c: int, devices: int) -> tuple[int, float]:
    """The gradients a device holds in the train step, in whole gradients: (its canonical shards' own, typed as the
    shard loop's parameters; fp32 ones of the reduction: the tree sum on one device; on a mesh, when C is a power
    of two, `ordered_sum`'s all-to-all buffers and its gathered sum, otherwise every shard's gathered and their
    sum). What `tessera plan` counts (`Deterministic._summed_grads` is the program)."""
    shards = max(1, c // devices)
    if devices == 1:
        return shards, 1.0
    return shards, 3.0 if _power_of_two(c) else c + 1.0


def state_specs(tree, param_specs: dict):
    """PartitionSpecs for an optimizer state: sub-dicts keyed like the params get theirs, the rest replicated."""
    is_params = lambda t: isinstance(t, dict) and set(t) == set(param_specs) and len(t) > 0  # noqa: E731
    return jax.tree.map(lambda t: dict(param_specs) if is_params(t) else P(), tree, is_leaf=is_params)


def per_layer(graph, c: int) -> bool:
    """Whether deterministic mode gathers each parameter where its layer reads it (tessera/lower/shard/layerwise.py):
    a language model whose canonical shard count C is a power of two (its train step also needs an elementwise
    optimizer, `_blockwise`; `tessera plan` asks the same)."""
    return not graph.losses and _power_of_two(c)


def _blockwise(opt_state) -> bool:
    """Whether the optimizer updates each element from its own gradient and state, once handed the whole
    gradient's norm and finiteness (`Deterministic._block_update`): everything tessera.run.optim builds but L-BFGS,
    whose update takes dot products over whole parameters and re-evaluates the loss."""
    lbfgs = lambda t: isinstance(t, optax.ScaleByLBFGSState)  # noqa: E731
    return not any(lbfgs(t) for t in jax.tree.leaves(opt_state, is_leaf=lbfgs))


def _per_spec(fn, specs, tree):
    """fn(leaf, spec) over a tree whose subtrees `specs` (a prefix tree of PartitionSpecs) describes."""
    return jax.tree.map(lambda s, sub: jax.tree.map(lambda leaf: fn(leaf, s), sub), specs, tree,
                        is_leaf=lambda s: isinstance(s, P))


class Deterministic:
    """The deterministic loss and train step of a program on its plan's mesh (one device included)."""

    def __init__(self, prog, mesh, param_specs: dict):
        self.prog, self.mesh, self.param_specs = prog, mesh, param_specs
        self.axes = tuple(a for a, n in mesh.shape.items() if n > 1)
        self.devices = mesh.size
        self._precast_types: dict[tuple[int, int], dict] = {}

    @functools.cached_property
    def whole_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each parameter's whole shape, by path."""
        return {k: tuple(v.shape) for k, v in self.prog.param_shapes().items()}

    @functools.cached_property
    def stacked(self) -> dict[str, int]:
        """{path: layers} of the parameters the model's repeat holds stacked."""
        return stacked_layers(self.prog.graph.body, self.prog.param_shapes())

    def unrolls(self, c: int) -> bool:
        """Whether this program's per-layer step over C canonical shards runs the layers unrolled
        (`layerwise.unrolls`)."""
        return layerwise.unrolls(c, self.prog.graph.attrs.get("fp8"))

    def _precast(self, fn, params: dict, batch: dict, c: int) -> dict:
        """params with those whose only use in one shard's fn(params, shard) is a single narrowing cast already cast
        (tessera/lower/precast.py): once here, not once per canonical shard in the loop. Values and gradients are
        bitwise those of the uncast parameters (the gradients come narrow; widened, they are the same bits)."""
        n = c // self.devices  # this device's shards of its block of the batch
        shard = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // n,) + a.shape[1:], a.dtype), batch)
        return precast.cast(params, self._hoistable(fn, params, shard))

    def _hoistable(self, fn, params: dict, *args) -> dict:
        """precast.hoistable of one shard's fn; nothing (and no trace) when the program computes in fp32 or wider,
        where no parameter is cast to a narrower type at its use."""
        if self.prog.graph.attrs.get("compute", "f32") in ("f32", "f64"):
            return {}
        return precast.hoistable(fn, params, *args)

    def _held(self, params: dict, history=None, unroll: bool = False) -> dict:
        """The fp8 weights a one-device per-layer step holds before its shard loop (fp8_held.before_shards, from
        `params` as the loop reads them; split into layers where the loop unrolls), else {}."""
        if self.axes:
            return {}
        return fp8_held.before_shards(self.prog.graph, self.prog.lower_ctx(mode="train"), params, history,
                                      param_bindings, layerwise.split if unroll else lambda h, _: h)

    def precast_types(self, batch: int, seq: int) -> dict:
        """{path: dtype} of the parameters a language model's train step casts once before its shard loop, for a
        global batch of `batch` x `seq` tokens (`tessera plan` counts their shard gradients narrow)."""
        if self.prog.graph.losses:
            return {}
        if (batch, seq) not in self._precast_types:  # traced once per shape (`mesh: auto` plans several meshes)
            rows = batch // canonical_shards(batch, self.prog.options.canonical_shards)
            shard = {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32) for k in ("tokens", "targets")}
            params = self.prog.param_shapes()
            # the loop's reads as the step makes them: fp8 weights held before it (from the narrow copies), which
            # a shard quantising its own would read beside its products' casts (two uses: nothing hoisted)
            held = jax.eval_shape(self._held, params)
            self._precast_types[batch, seq] = self._hoistable(lambda p, sh, h: self.shard_sums({**p, **h}, sh)[0],
                                                              params, shard, held)
        return self._precast_types[batch, seq]

    def _shards(self, batch: dict) -> tuple[int, dict]:
        b = next(iter(batch.values())).shape[0]  # tokens, or a scientific model's samples (u0, u1)
        c = canonical_shards(b, self.prog.options.canonical_shards)
        check_canonical(self.prog.options, b, self.devices)
        return c, {k: P(self.axes or None, *([None] * (jnp.ndim(v) - 1))) for k, v in batch.items()}

    def shard_sums(self, params, shard: dict, param_use=None, tensor=None, experts=None, unroll: bool = False):
        """(loss sum, count, {term: sum}) of one canonical shard: the same function on the same shapes everywhere.
        A language model's: its tokens' cross-entropy and how many count; a model with loss entries: its
        weighted objective on the shard (a mean over the shard's samples), counted once, and its terms. `tensor`:
        on a tp mesh whose tp splits the compute, this device's chunks (det_tensor.tensor_grads); `experts`: ep's
        likewise; `unroll`: the layers unrolled (`unrolled`), over `params` split into their layers where the caller
        split them before the shard loop (any still stacked are split here)."""
        extra = {k: v for k, v in (("tensor", tensor), ("experts", experts)) if v is not None}
        if unroll:
            params, extra["unroll"] = layerwise.split(params, self.stacked), True
        if self.prog.graph.losses:
            total, terms = self.prog.objective(params, shard)
            return total, jnp.ones((), total.dtype), terms
        # without remat, the layers keep every value but the gathered parameters (gathered again in the backward)
        remat = layerwise.saveable_but_gathers if param_use else None
        if det_pipeline.splits(self.prog.graph):  # the ends fenced, as a pp mesh's stages compute them
            ctx = self.prog.lower_ctx(mode="train", param_use=param_use, layer_remat=remat, **extra)
            embed, layers, head = det_pipeline.pieces(self.prog, ctx)
            x = layers(params, fenced(embed, det_pipeline.only(params, embed.reads), shard["tokens"]))
            s, n = fenced(head, det_pipeline.only(params, head.reads), x, shard["targets"], shard.get("mask"))
            return s, n, {}
        logits = self.prog.logits(params, shard["tokens"], "train", param_use=param_use, layer_remat=remat, **extra)
        per_token = token_cross_entropy(logits, shard["targets"])
        w = jnp.ones_like(per_token) if shard.get("mask") is None else shard["mask"].astype(per_token.dtype)
        return token_sum(per_token * w), jnp.sum(w), {}

    def _local_shards(self, fn, batch: dict, c: int):
        """fn over this device's canonical shards (C / devices of them, in canonical order), stacked."""
        local = jax.tree.map(lambda a: a.reshape((c // self.devices, -1) + a.shape[1:]), batch)
        return per_shard(fn, local, c // self.devices)

    def _gathered(self, out):
        """Per-shard results of this device, those of all C shards in canonical order."""
        if not self.axes:
            return out
        return jax.tree.map(lambda a: jax.lax.all_gather(a, self.axes, axis=0, tiled=True), out)

    def _per_shard(self, fn, batch: dict, c: int):
        """fn over this device's canonical shards, results of all C shards gathered in canonical order."""
        return self._gathered(self._local_shards(fn, batch, c))

    def _summed_grads(self, grads: dict, widths: dict, c: int) -> dict:
        """This device's per-shard gradients [C / devices, ...] -> the gradients of all C shards tree-summed in
        canonical order (tree_sum over them), on every device. One device: its C shards. On n devices when C is a
        power of two, each device's C / n shards are one aligned subtree of that tree, so each device sums its own
        and the n subtree sums meet in `ordered_sum` (device order is canonical order): each device holds one
        gradient where gathering would hold C. Otherwise (a subtree spans devices) all C are gathered. Narrow
        (precast) gradients are widened before any sum (exact: the cast's transpose). The sum is computed apart
        from the update on every mesh, one device included: fused into the update, it made XLA:CPU reduce the
        gradient norm in another order on one device than on a mesh (the last bit of gpt_oss_tiny's norm)."""
        if self.axes and _power_of_two(c):
            return {k: ordered_sum(tree_sum(g.astype(widths[k])), self.axes) for k, g in grads.items()}
        return {k: tree_sum(g.astype(widths[k])) for k, g in self._gathered(grads).items()}

    def loss(self, params, batch: dict):
        """Mean loss over the batch, reduced in the canonical tree."""
        c, bspecs = self._shards(batch)

        def body(params, batch):
            if self._per_layer(c):  # each parameter gathered where its layer reads it, as the train step does
                tokens, unroll = batch["tokens"], self.unrolls(c)
                narrow = self.precast_types(tokens.shape[0] * self.devices, tokens.shape[1])
                cast, hooks, held = precast.cast(params, narrow), None, params
                if unroll:
                    cast, held = (layerwise.split(t, self.stacked) for t in (cast, params))
                if self.axes:
                    top, hooks = self._layer_gathers()
                    cast = top({k: layerwise.held(v, cast[k] if k in narrow else None) for k, v in held.items()})
                sums, counts, _ = self._per_shard(
                    lambda sh: self.shard_sums(cast, sh, param_use=hooks, unroll=unroll), batch, c)
                return tree_sum(sums) / jnp.maximum(tree_sum(counts), 1.0)
            return self._mean_loss({k: gather_full(v, self.param_specs[k]) for k, v in params.items()}, batch, c)

        return jax.shard_map(body, mesh=self.mesh, in_specs=(self.param_specs, bspecs), out_specs=P(),
                             check_vma=False)(params, batch)

    def train_step(self, state, batch: dict):
        """One optimizer step: canonical per-shard gradients, tree-reduced, each device's block updated (L-BFGS:
        the whole tensors, on every device)."""
        c, bspecs = self._shards(batch)
        prog, specs = self.prog, self.param_specs
        ospecs = state_specs(state.opt_state, specs)
        blockwise = _blockwise(state.opt_state)
        per_layer = blockwise and self._per_layer(c)
        pipelined = tensor = None
        if per_layer:
            tokens = batch["tokens"]
            narrow = self.precast_types(tokens.shape[0], tokens.shape[1])
            pipelined = self.pipeline_layout(c)
            tensor = self.tensor_layout(c)

        def body(params, opt_state, batch):
            opt = opt_state if blockwise else _per_spec(gather_full, ospecs, opt_state)
            ls = loss_scale.state_of(opt)  # None unless the loss is scaled (lower/loss_scale.py)
            history = fp8_delayed.history_of(opt)  # delayed fp8 scaling's amax histories (lower/fp8_delayed.py)
            if pipelined is not None:  # pp splits the layers' compute (tessera/lower/shard/det_pipeline.py)
                grads, sums, counts, terms, amaxes = det_pipeline.pipelined_grads(self, pipelined, params, history,
                                                                                  batch, c, ls, narrow, tensor)
                return self._block_update(params, opt, None, sums, counts, terms, amaxes, ls, c, blocks=grads)
            if tensor is not None:  # tp splits the attention and MLP compute (tessera/lower/shard/det_tensor.py)
                from tessera.lower.shard import det_tensor  # (it imports this module)

                grads, sums, counts, terms, amaxes = det_tensor.tensor_grads(self, tensor, params, batch, c, ls, narrow)
                return self._block_update(params, opt, None, sums, counts, terms, amaxes, ls, c, blocks=grads)
            if per_layer:
                grads, sums, counts, terms, amaxes = self._per_layer_grads(params, history, batch, c, ls, narrow)
                return self._block_update(params, opt, None, sums, counts, terms, amaxes, ls, c, blocks=grads)
            full = {k: gather_full(v, specs[k]) for k, v in params.items()}

            def scaled(p, sh):  # the histories ride beside the params: their "gradients" are the shard's amaxes
                s, n, terms = self.shard_sums(p, sh)
                return (s if ls is None else s * ls.scale), (n, terms)

            grad_fn = jax.value_and_grad(scaled, has_aux=True)
            inputs = self._precast(lambda p, sh: scaled(p, sh)[0], fp8_delayed.merged(full, history), batch, c)
            (sums, (counts, terms)), grads = self._local_shards(lambda sh: grad_fn(inputs, sh), batch, c)
            grads, amaxes = fp8_delayed.split(grads, history)
            sums, counts, terms, amaxes = self._gathered((sums, counts, terms, amaxes))
            grads = self._summed_grads(grads, {k: v.dtype for k, v in full.items()}, c)
            if blockwise:
                return self._block_update(params, opt, grads, sums, counts, terms, amaxes, ls, c)

            def update(grads, sums, counts, terms, amaxes, opt, full):
                count = jnp.maximum(tree_sum(counts), 1.0)
                grads = {k: g / count for k, g in grads.items()}
                amaxes = None if amaxes is None else {k: jnp.max(a, axis=0) for k, a in amaxes.items()}  # exact
                if ls is not None:  # unscaled in fp32; a non-finite one makes the optimizer skip the step
                    sums = sums / ls.scale
                    grads = {k: g / ls.scale for k, g in grads.items()}
                loss = tree_sum(sums) / count
                with jax.named_scope("optimizer"):
                    extra = {} if not prog.graph.losses else dict(  # L-BFGS's line search re-evaluates the objective
                        value=loss, grad=grads, value_fn=self._mean_loss_fn(batch, c))
                    updates, opt = prog.optimizer.update(grads, opt, full, **extra)
                    new = optax.apply_updates(full, updates)
                    new = {k: new[k].astype(full[k].dtype) for k in full}
                opt = fp8_delayed.pushed(opt, amaxes)
                metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **loss_scale.metrics(opt),
                           **{k: tree_sum(v) / count for k, v in terms.items()}}
                if prog.lr_fn is not None:
                    metrics["lr"] = prog.lr_fn(opt)
                return new, opt, metrics

            # The reduction and the update compile on their own (`fenced`): in one program with their inputs'
            # gathers and their outputs' slices, XLA fuses them with those, and XLA:CPU contracts a*b+c*d into
            # an fma on whichever product the fusion's code puts first (ep=2 stored Adam's first moment of the
            # split experts as fma(0.9, mu, 0.1*g), one device as fma(0.1, g, 0.9*mu)).
            new, opt, metrics = fenced(update, grads, sums, counts, terms, amaxes, opt, full)
            return ({k: local_block(v, specs[k]) for k, v in new.items()},
                    _per_spec(local_block, ospecs, opt), metrics)

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, ospecs, bspecs), out_specs=(specs, ospecs, P()),
                           check_vma=False)
        params, opt_state, metrics = fn(state.params, state.opt_state, batch)
        return type(state)(state.step + 1, params, opt_state), metrics

    def pipeline_layout(self, c: int):
        """The pp layout (det_pipeline.Layout) where the train step splits the layers' compute over pp stages, else
        None (pp, if any, then acts as a data axis; `pipeline_reason` says why)."""
        return self._pipeline_plan(c)[0]

    def _pipeline_plan(self, c: int):
        return det_pipeline.plan(self.prog.graph, self.prog.param_shapes(), dict(self.mesh.shape), self.param_specs, c)

    def pipeline_record(self, c: int, opt_state) -> dict | None:
        """On a pp mesh, what the manifest records of the train step's pipeline (for a train state's `opt_state`):
        {stages, split_compute: whether the stages split the layers' compute, why_not: else the reason pp acts as
        a data axis}; None without pp. `tessera plan` computes the same (tessera/run/plan.py `pipeline_record`)."""
        stages = dict(self.mesh.shape).get(det_pipeline.PP, 1)
        if stages <= 1:
            return None
        per_layer = _blockwise(opt_state) and self._per_layer(c)
        reason = "" if per_layer else det_pipeline.NOT_PER_LAYER
        return det_pipeline.record(stages, reason or self._pipeline_plan(c)[1])

    def tensor_layout(self, c: int):
        """The layout (det_tensor.Layout) where the train step splits compute over tp (attention, MLP and experts'
        hidden dims), ep (the experts) or both, else None (they then act as data axes; `tensor_record` says why)."""
        return self._tensor_plan(c)[0]

    def _tensor_plan(self, c: int):
        from tessera.lower.shard import det_tensor

        opts = self.prog.options
        if self.prog.graph.attrs.get("fp8"):
            why = "fp8 compute (each chunk would scale by its own amax)"
            return None, {a: why for a in (det_tensor.TP, det_tensor.EP)}
        return det_tensor.plan(self.prog.graph, self.prog.param_shapes(), dict(self.mesh.shape), self.param_specs, c,
                               {det_tensor.TP: opts.canonical_tp, det_tensor.EP: opts.canonical_ep},
                               self.pipeline_layout(c))

    def tensor_record(self, c: int, opt_state, axis: str = "tp") -> dict | None:
        """On a tp (or ep) mesh, what the manifest records of whether the train step splits compute over that axis
        (for a train state's `opt_state`): {tp (or ep), split_compute, why_not}; None without the axis."""
        from tessera.lower.shard import det_tensor

        size = dict(self.mesh.shape).get(axis, 1)
        if size <= 1:
            return None
        if not (_blockwise(opt_state) and self._per_layer(c)):
            return det_tensor.record(size, det_pipeline.NOT_PER_LAYER, axis)
        return det_tensor.record(size, self._tensor_plan(c)[1][axis], axis)

    def _per_layer(self, c: int) -> bool:
        """Whether the step gathers the parameters per layer (`per_layer`), on every mesh of that C and on one
        device alike (one program, so the same bits)."""
        return per_layer(self.prog.graph, c)

    @functools.cached_property
    def at_use(self) -> set[str]:
        """The parameters gathered where their one op reads them (layerwise.use_plan)."""
        shapes = self.prog.param_shapes()
        return layerwise.use_plan(self.prog.graph, self.param_specs, stacked_layers(self.prog.graph.body, shapes))

    def _layer_gathers(self):
        """(top, hooks) for a mesh: `top` makes whole, once per shard, the `layerwise.Held` blocks of the parameters
        not gathered at their use; `hooks` ({path: fn}, `Program.logits`' param_use) gathers the others where their
        op reads them. Each gather's VJP sums the devices' block gradients in device order (gather_at_use)."""
        sizes = dict(self.mesh.shape)

        def gather(k, held):
            return layerwise.gather_at_use(held, self.param_specs[k], len(self.whole_shapes[k]), self.axes, sizes)

        def top(p):
            return {k: layerwise.each(functools.partial(gather, k), v) if k in self.param_specs and k not in self.at_use
                    else v for k, v in p.items()}

        return top, {k: functools.partial(gather, k) for k in self.at_use}

    def _per_layer_grads(self, params: dict, history, batch: dict, c: int, ls, narrow: dict):
        """(gradient blocks summed over all C shards, per-shard loss sums, counts, terms and amaxes in canonical
        order) with each parameter gathered where it is used (tessera/lower/shard/layerwise.py): device d runs
        shards d, n + d, ...; each gather's VJP sums the n devices' block gradients of one iteration in device
        order, and the iterations' sums are tree-summed: the canonical tree's adds, as on one device."""
        n, m = self.devices, c // self.devices
        # One device: the gradient is taken at the parameters as the shard loop reads them (the narrow copy where
        # precast.py finds one, widened at the tree). A mesh: at the held blocks, through each gather's VJP.
        one, unroll = not self.axes, self.unrolls(c)
        cast = precast.cast(params, narrow)
        diff = cast if one else params
        # one device: fp8 weights quantised once here, not by every shard (lower/fp8_held.py); {} otherwise
        held = self._held(cast, history, unroll)
        if unroll:  # each layer's weights their own buffers, split once here (layerwise.py)
            cast, diff = (layerwise.split(t, self.stacked) for t in (cast, diff))
        top, hooks = (None, None) if one else self._layer_gathers()

        def scaled(p, sh):  # blocks in; the ones read by one op gathered there, the rest once per shard here
            if not one:
                p = top({k: layerwise.held(v, cast[k] if k in narrow else None) if k in self.param_specs else v
                         for k, v in p.items()})
            s, count, terms = self.shard_sums({**p, **held}, sh, param_use=hooks, unroll=unroll)
            return (s if ls is None else s * ls.scale), (count, terms)

        inputs = fp8_delayed.merged(diff, history)
        grad_fn = jax.value_and_grad(scaled, has_aux=True)
        local = layerwise.interleaved(batch, self.axes, n, m)
        sums, counts, terms, amaxes, grads = shard_gradients(lambda sh: grad_fn(inputs, sh), local, m,
                                                             {k: v.dtype for k, v in params.items()}, history)
        gathered = self._gathered((sums, counts, terms, amaxes))
        sums, counts, terms, amaxes = jax.tree.map(lambda a: layerwise.canonical_order(a, n, m), gathered)
        return grads, sums, counts, terms, amaxes

    def _block_update(self, params, opt, grads, sums, counts, terms, amaxes, ls, c: int, blocks=None):
        """(new parameter blocks, new optimizer state blocks, metrics). What needs the whole gradient (its global
        norm, whether it is finite) is computed alike on every mesh: from the whole summed gradients `grads` where
        the step holds them, else (grads None) from this device's summed `blocks` by canonical chunks
        (layerwise.canonical_square_sums, C of them a tensor). Then the optimizer updates this device's blocks,
        handed that norm (clipping) and finiteness (loss scaling): the optimizer state is never gathered and only
        blocks of the new parameters are computed. The reductions and the update compile on their own (`fenced`):
        the update's elementwise arithmetic is then the same on a block as on the whole tensor (on the CPU too,
        where XLA contracts a*b+c*d into an fma as the fusion orders it)."""
        prog, specs = self.prog, self.param_specs

        def normalised(grads, count):
            return {k: one(g, count) for k, g in grads.items()}

        def one(g, count):  # a gradient as the optimizer reads it: the shards' mean, unscaled
            g = g / count
            return g if ls is None else g / ls.scale

        def reduce(grads, sums, counts, terms, amaxes):
            count = jnp.maximum(tree_sum(counts), 1.0)
            loss = tree_sum(sums if ls is None else sums / ls.scale) / count
            amaxes = None if amaxes is None else {k: jnp.max(a, axis=0) for k, a in amaxes.items()}  # exact
            metrics = {"loss": loss, **{k: tree_sum(v) / count for k, v in terms.items()}}
            if grads is not None:
                grads = normalised(grads, count)
                metrics["grad_norm"] = optax.tree.norm(grads)
                metrics["finite"] = None if ls is None else loss_scale.all_finite_of(grads)
            return count, metrics, amaxes

        count, metrics, amaxes = fenced(reduce, grads, sums, counts, terms, amaxes)
        if grads is not None:
            blocks = {k: local_block(g, specs[k]) for k, g in grads.items()}
        else:
            metrics["grad_norm"], metrics["finite"] = self._canonical_norm(blocks, c, lambda g: one(g, count),
                                                                           finite=ls is not None)
        finite = metrics.pop("finite")

        def update(blocks, count, norm, finite, amaxes, opt, params):
            with jax.named_scope("optimizer"):
                updates, opt = prog.optimizer.update(normalised(blocks, count), opt, params, global_norm=norm,
                                                     all_finite=finite)
                new = optax.apply_updates(params, updates)
                new = {k: new[k].astype(params[k].dtype) for k in params}
            opt = fp8_delayed.pushed(opt, amaxes)
            extra = dict(loss_scale.metrics(opt))
            if prog.lr_fn is not None:
                extra["lr"] = prog.lr_fn(opt)
            return new, opt, extra

        new, opt, extra = fenced(update, blocks, count, metrics["grad_norm"], finite, amaxes, opt, params)
        return new, opt, {**metrics, **extra}

    def _canonical_norm(self, blocks: dict, c: int, prep, finite: bool = True):
        """(the global norm, whether every element is finite) of gradients held in blocks, the same bits on every
        mesh: each tensor's C canonical chunks' sums of squares (layerwise.canonical_square_sums; a tensor no dim of
        which C divides is gathered whole and summed once), tree-summed per tensor, then over the tensors in path
        order. Finiteness is a min over the devices (exact); None unless `finite` (only loss scaling reads it, and the
        check reads every gradient once more). `prep` (elementwise: the mean over the shards, unscaled) is applied
        inside each chunk's reduction: applied before, its result was every gradient written once more as the
        chunk loop's input."""
        sizes, per = dict(self.mesh.shape), []
        for k in sorted(blocks):
            g, shape = blocks[k], self.whole_shapes[k]
            sq = layerwise.canonical_square_sums(g, self.param_specs[k], shape, c, sizes, prep)
            if sq is None:
                whole = gather_full(g, self.param_specs[k])
                sq = opaque_map(lambda w: layerwise.square_sum(prep(w)), whole[None], 1)
            per.append(tree_sum(sq))
        norm = jnp.sqrt(tree_sum(jnp.stack(per)))
        if not finite:
            return norm, None
        every = loss_scale.all_finite_of({k: prep(g) for k, g in blocks.items()}).astype(jnp.int32)
        if self.axes:
            every = jax.lax.pmin(every, self.axes)
        return norm, every.astype(bool)

    def _mean_loss_fn(self, batch: dict, c: int):
        """The mean loss at whole params, differentiable: L-BFGS's line search takes values and gradients of it
        at trial params. `_local_shards`' loop is one JAX cannot reverse-differentiate, so the gradient is the train
        step's own: each canonical shard's, tree-summed, as its VJP (first order)."""
        def value_and_grad(p, batch):
            grad_fn = jax.value_and_grad(lambda q, sh: self.shard_sums(q, sh)[:2], has_aux=True)
            (sums, counts), grads = self._local_shards(lambda sh: grad_fn(p, sh), batch, c)
            sums, counts = self._gathered((sums, counts))
            grads = self._summed_grads(grads, {k: v.dtype for k, v in p.items()}, c)
            count = jnp.maximum(tree_sum(counts), 1.0)
            return tree_sum(sums) / count, {k: g / count for k, g in grads.items()}

        @jax.custom_vjp
        def mean_loss(p, batch):
            return self._mean_loss(p, batch, c)

        def fwd(p, batch):
            value, grads = value_and_grad(p, batch)
            return value, (grads, batch)

        def bwd(res, g):
            grads, batch = res
            no_grad = jax.tree.map(  # the batch is data: integer leaves take float0 cotangents
                lambda a: np.zeros(a.shape, jax.dtypes.float0) if not jnp.issubdtype(a.dtype, jnp.inexact)
                else jnp.zeros_like(a), batch)
            return {k: (g * v).astype(v.dtype) for k, v in grads.items()}, no_grad

        mean_loss.defvjp(fwd, bwd)
        return lambda p: mean_loss(p, batch)

    def _mean_loss(self, full: dict, batch: dict, c: int):
        """The loss at whole params `full`: this device's canonical shards, all C gathered and tree-summed."""
        full = self._precast(lambda p, sh: self.shard_sums(p, sh)[0], full, batch, c)
        sums, counts, _ = self._per_shard(lambda sh: self.shard_sums(full, sh), batch, c)
        return tree_sum(sums) / jnp.maximum(tree_sum(counts), 1.0)

    def forward(self, params, x):
        """The model's output for inputs x on every device: whole params, the whole batch (a scientific model's
        evaluation on its held-out samples; no reduction crosses devices)."""
        def body(params, x):
            full = {k: gather_full(v, self.param_specs[k]) for k, v in params.items()}
            return self.prog.logits(full, x, "forward")

        return jax.shard_map(body, mesh=self.mesh, in_specs=(self.param_specs, P()), out_specs=P(),
                             check_vma=False)(params, x)
