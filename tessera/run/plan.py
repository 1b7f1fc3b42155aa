"""`tessera plan SPEC`: parameters, memory, FLOPs and communication per device, from the spec alone.

Every figure is counted from the program's Graph IR by `tessera.ir.cost`; this module adds the task's
shapes, the optimizer and the device, an ahead-of-time compile against abstract inputs, and the two ways
of printing the report (a table, or JSON in the schema documented in docs/plan.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

from tessera.diagnostics import did_you_mean, error
from tessera.ir import cost

SCHEMA = "tessera.plan/1"
GIB = float(2 ** 30)


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator: memory (bytes, as the vendor prints GB = 1e9), dense bf16 FLOP/s, memory bandwidth."""

    name: str
    memory: float
    peak_flops: float | None
    bandwidth: float | None


DEVICES = {
    "h100": Device("NVIDIA H100 SXM 80 GB", 80e9, 989e12, 3.35e12),
    "h200": Device("NVIDIA H200 SXM 141 GB", 141e9, 989e12, 4.8e12),
    "a100": Device("NVIDIA A100 SXM 80 GB", 80e9, 312e12, 2.039e12),
    "b200": Device("NVIDIA B200 180 GB", 180e9, 2250e12, 8.0e12),
    "l40s": Device("NVIDIA L40S 48 GB", 48e9, 362e12, 0.864e12),
    "tpu-v5p": Device("Google TPU v5p 95 GB", 95e9, 459e12, 2.765e12),
}


def cpu_device() -> Device:
    """This machine's CPU: its physical memory (FLOP/s and bandwidth unknown)."""
    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return Device(f"CPU ({os.cpu_count()} cores, this machine)", memory, None, None)


def pick_device(name: str | None) -> tuple[str, Device]:
    """The named device, or (None) the kind of this machine's first accelerator, else the CPU."""
    if name is None:
        import jax

        kind = jax.devices()[0].device_kind.lower()
        name = next((key for key in DEVICES if key in kind), "cpu")
    key = name.lower()
    if key == "cpu":
        return key, cpu_device()
    if key not in DEVICES:
        raise error(f"unknown device `{name}`", key="--device",
                    hint=did_you_mean(key, [*DEVICES, "cpu"]) or f"devices: {', '.join([*DEVICES, 'cpu'])}")
    return key, DEVICES[key]


# ---- the report ----------------------------------------------------------------------------------------

def array_bits(dtype: str) -> float:
    """Bits per element of what the program holds for a param (mxfp4 packed: 4.25; fp8/fp6/fp4: bf16, 16)."""
    from tessera.lower.storage import storage_bits

    return storage_bits(dtype)


def optimizer_states(exp) -> int:
    """Optimizer state tensors per parameter: adam/adamw keep mu and nu; sgd its momentum, if any; L-BFGS (alone,
    or after `lbfgs_after` steps of the first, whose state stays) 2 x memory of parameter and gradient differences
    plus 3 (the last parameters and update, and the line search's gradient: optax.lbfgs's state)."""
    opt = getattr(exp.task, "optimizer", None)
    name = getattr(opt, "name", "adamw")
    lbfgs = 2 * int(getattr(opt, "lbfgs_memory", 0) or 0) + 3
    if name == "lbfgs":
        return lbfgs
    first = 2 if name in ("adam", "adamw") else 1 if getattr(opt, "momentum", 0.0) else 0
    return first + (lbfgs if getattr(opt, "lbfgs_after", None) is not None else 0)


def _trains(exp) -> bool:
    from tessera.spec.tasks import trains

    return trains(exp.task)


def _canonical(exp) -> int:
    """Deterministic mode's canonical shards of the task's batch."""
    from tessera.lower.shard.deterministic import canonical_shards

    return canonical_shards(cost.task_dims(exp)["batch"], exp.parallel.canonical_shards)


def _sums_after_the_shards(exp) -> bool:
    """Deterministic training on one device whose canonical shards each run as a conditional's branch
    (shard_loop.per_shard, up to BRANCHED_UP_TO of them): the last shard's activations are freed before the
    gradients' fp32 tree sum is written, so the peak holds the larger of the two, not both. GPT-OSS-20B's two layers
    at C = 2 on one H100 (session 39): a 49.6 GiB peak, which the plan counting both put at 56.8."""
    from tessera.lower.shard.shard_loop import BRANCHED_UP_TO

    return (bool(exp.parallel.deterministic) and exp.mesh.size == 1 and not _one_objective(exp)
            and _canonical(exp) <= BRANCHED_UP_TO)


def _summed_bytes(exp, graph) -> float:
    """Bytes of the fp32 tree sum of one device's canonical shards' gradients (`gradient_bytes`' reduction)."""
    from tessera.lower.shard.deterministic import gradient_buffers

    _, reduction = gradient_buffers(_canonical(exp), 1)
    return sum(4.0 * reduction * t.numel() for t in _held(exp, graph).values())


def _whole_on_mesh(exp) -> bool:
    """Deterministic mode on a mesh: every device gathers the whole model for the step and computes whole
    gradients (tessera/lower/shard/deterministic.py), whatever the mesh splits for storage."""
    return bool(exp.parallel.deterministic) and exp.mesh.size > 1


def _gathers_optimizer_state(exp) -> bool:
    """Whether deterministic mode gathers the optimizer state whole for the update: only for L-BFGS (alone or after
    `lbfgs_after` steps), whose update is not elementwise; every other optimizer updates each device's blocks."""
    opt = getattr(exp.task, "optimizer", None)
    return getattr(opt, "name", None) == "lbfgs" or getattr(opt, "lbfgs_after", None) is not None


def _one_objective(exp) -> bool:
    """A model trained on collocation points: one objective over every point, no canonical shards
    (Program.canonical_objective)."""
    return getattr(getattr(exp.task, "data", None), "kind", None) == "collocation"


def gradient_bytes(exp, dtype: str, precast=None) -> float:
    """Bytes of gradient buffers the train step holds per parameter element of storage type `dtype`.

    Fast mode, one microbatch: the backward pass's gradient (as the param is held), cast to fp32 unless it
    is fp32 or fp64 already; so too a model trained on collocation points (one objective, no canonical
    shards). Several microbatches: one microbatch's gradient plus the fp32 accumulator.
    Deterministic mode (`deterministic.gradient_buffers`; on a mesh per element of the whole parameter): an fp32
    gradient per canonical shard of the device, plus the reduction's fp32 ones (their tree sum on one device; on
    dp=8, llama_tiny at d_model 256 compiled to 29.4 MB of temporaries, four whole gradients); for a parameter the
    shard loop gets cast once (`precast`, its narrow dtype: tessera/lower/precast.py), the narrow copy and a narrow
    gradient per shard. (Measured on one H200 with the sum held apart from the update, as it is computed to keep
    the update's arithmetic the same on every mesh: Llama-1B 42.7 GiB against this model's 43.4, 20b-layers 54.6
    against 58.3.)"""
    held = array_bits(dtype) / 8
    if exp.parallel.deterministic and not _one_objective(exp):
        from tessera.lower.shard.deterministic import gradient_buffers

        shards, reduction = gradient_buffers(_canonical(exp), exp.mesh.size)
        return (precast.itemsize if precast is not None else 4.0) * shards + 4.0 * reduction  # a numpy dtype
    if (getattr(exp.task, "microbatches", 1) or 1) == 1:
        return held if held >= 4 else 4.0 + held  # fp32 and fp64 gradients as held; narrower ones widened
    return 4.0 + held


def param_memory(graph, layout: cost.Layout, exp, train: bool, bits=cost.bits_per_element) -> dict:
    """Per-device bytes of parameters (`bits` a storage type's: the IR's count, or `array_bits` as the program's
    arrays hold them), gradients and optimizer state."""
    params = grads = opt = 0.0
    states = optimizer_states(exp)
    narrow = _precast(exp) if train else {}
    if train and _whole_on_mesh(exp) and _per_layer(exp, graph):
        return _per_layer_memory(graph, layout, exp, bits, narrow)
    whole = train and _whole_on_mesh(exp)
    for path, t in _held(exp, graph).items():
        n = layout.per_device(t)
        params += n * bits(t.dtype) / 8
        if train:
            grads += (t.numel() if whole else n) * gradient_bytes(exp, t.dtype, narrow.get(path))
            opt += states * n * array_bits(t.dtype) / 8
            if whole and n < t.numel():  # a split parameter gathered whole for the step (L-BFGS: its states too)
                params += t.numel() * bits(t.dtype) / 8
                if _gathers_optimizer_state(exp):
                    opt += states * t.numel() * array_bits(t.dtype) / 8
    if train:
        opt += delayed_history_bytes(graph)
    return {"params": params, "gradients": grads, "optimizer": opt}


def _per_layer(exp, graph) -> bool:
    """Deterministic training that gathers each parameter where it is used (tessera/lower/shard/layerwise.py): a
    language model whose canonical shard count is a power of two, with an elementwise optimizer."""
    from tessera.lower.shard.deterministic import per_layer

    return per_layer(graph, _canonical(exp)) and not _gathers_optimizer_state(exp)


def _shapes_and_specs(held_types: dict, layout: cost.Layout) -> tuple[dict, dict]:
    """({path: an object with the held `.shape`}, {path: its PartitionSpec on the layout's mesh})."""
    import types

    from jax.sharding import PartitionSpec as P

    shapes = {p: types.SimpleNamespace(shape=tuple(d.size for d in t.dims)) for p, t in held_types.items()}
    return shapes, {p: P(*[layout.split(t).get(d.name) for d in t.dims]) for p, t in held_types.items()}


def pipeline_record(exp, graph, layout: cost.Layout) -> dict | None:
    """Deterministic training on a pp mesh: {stages, split_compute, why_not}, as `tessera run` records it
    (`Deterministic.pipeline_record`): whether the stages split the layers' compute or pp acts as a data axis."""
    from tessera.lower.shard import det_pipeline

    stages = layout.mesh.get(det_pipeline.PP, 1)
    if stages <= 1 or not exp.parallel.deterministic or not _trains(exp) or graph.losses:
        return None
    if not _per_layer(exp, graph):
        why = det_pipeline.NOT_PER_LAYER
    else:
        shapes, specs = _shapes_and_specs(_held(exp, graph), layout)
        why = det_pipeline.plan(graph, shapes, layout.mesh, specs, _canonical(exp))[1]
    return det_pipeline.record(stages, why)


def _tensor_layout(exp, graph, layout: cost.Layout, shapes: dict, specs: dict):
    """(det_tensor.Layout or None, {axis: why}): where deterministic tp and ep split the compute on this mesh (the
    train step's `Deterministic.tensor_layout`)."""
    from tessera.lower.shard import det_pipeline, det_tensor

    chunks = {det_tensor.TP: int(exp.parallel.canonical_tp or 1), det_tensor.EP: int(exp.parallel.canonical_ep or 1)}
    pipe = det_pipeline.plan(graph, shapes, layout.mesh, specs, _canonical(exp))[0]
    return det_tensor.plan(graph, shapes, layout.mesh, specs, _canonical(exp), chunks, pipe)


def tensor_record(exp, graph, layout: cost.Layout, axis: str = "tp") -> dict | None:
    """Deterministic training on a tp (or ep) mesh: {tp (or ep), split_compute, why_not}, as `tessera run` records it
    (`Deterministic.tensor_record`)."""
    from tessera.lower.shard import det_pipeline, det_tensor

    size = layout.mesh.get(axis, 1)
    if size <= 1 or not exp.parallel.deterministic or not _trains(exp) or graph.losses:
        return None
    if not _per_layer(exp, graph):
        return det_tensor.record(size, det_pipeline.NOT_PER_LAYER, axis)
    shapes, specs = _shapes_and_specs(_held(exp, graph), layout)
    return det_tensor.record(size, _tensor_layout(exp, graph, layout, shapes, specs)[1][axis], axis)


def _per_layer_memory(graph, layout: cost.Layout, exp, bits, narrow: dict) -> dict:
    """`param_memory` of the per-layer deterministic step on a mesh: each device's blocks, its optimizer state's,
    and what layerwise.planned_bytes counts (gathered parameters, gradient blocks)."""
    from tessera.lower.interpret import stacked_layers
    from tessera.lower.shard import det_pipeline, layerwise

    held_types = _held(exp, graph)
    stacked_shapes, specs = _shapes_and_specs(held_types, layout)
    stacked = stacked_layers(graph.body, stacked_shapes)
    at_use = layerwise.use_plan(graph, specs, stacked)
    c = _canonical(exp)
    m = c // exp.mesh.size
    # on a pp mesh whose stages split the layers (tessera/lower/shard/det_pipeline.py): each stage's layers gathered
    # where they are read; a device group's m = C / (data devices) shards' gradient blocks, their tree sum, a tick's
    # gradient and the select that stores it in its slot (m + 3 blocks: llama_tiny at d_model 256, 8 layers, pp=2 x
    # dp=4 compiled to 131.0 MB a device, counted 127.7); stage 0's ring of a tied table's head-side cotangents (pp
    # of them, whole). Not counted: the stash of min(m, 2 pp - 1) stage inputs (one shard's activations each).
    pipe = det_pipeline.plan(graph, stacked_shapes, layout.mesh, specs, c)[0]
    ring = 0.0
    if pipe is not None:
        at_use |= pipe.stacked
        m = c // math.prod(layout.mesh[a] for a in pipe.data_axes) + 2  # planned_bytes counts m + 1
        ring = pipe.stages * sum(held_types[p].numel() * (narrow[p].itemsize if p in narrow else
                                                          array_bits(held_types[p].dtype) / 8)
                                 for p in pipe.pre_reads & pipe.post_reads)
    # on a tp mesh whose tp splits the attention and MLP compute (tessera/lower/shard/det_tensor.py): a tp group's
    # shards (C over the data devices), each chunked parameter gathered as its tp slice
    tensor = _tensor_layout(exp, graph, layout, stacked_shapes, specs)[0]
    if tensor is not None:  # (inside a pipeline's stages too: the group's devices run the same shards)
        m = c // math.prod(layout.mesh[a] for a in tensor.data_axes) + (2 if pipe is not None else 0)
    params = opt = 0.0
    rows = []
    for path, t in held_types.items():
        n = layout.per_device(t)
        params += n * bits(t.dtype) / 8
        opt += optimizer_states(exp) * n * array_bits(t.dtype) / 8
        slice_of = tensor.slice_of(path) if tensor is not None else 1
        rows.append({"numel": t.numel() // slice_of, "block": n, "wide": array_bits(t.dtype) / 8,
                     "narrow": narrow[path].itemsize if path in narrow else 0, "at_use": path in at_use,
                     "layers": stacked.get(path, 1)})
    extra = layerwise.planned_bytes(rows, m, exp.mesh.size)
    return {"params": params + extra["params"], "gradients": extra["gradients"] + ring,
            "optimizer": opt + delayed_history_bytes(graph)}


def _precast(exp) -> dict:
    """Deterministic training of a language model: {path: narrow dtype} of the parameters its shard loop gets cast
    once (found in one shard's traced loss, as the train step finds them; nothing is compiled)."""
    if not exp.parallel.deterministic or not _trains(exp):
        return {}
    from tessera.lower.program import compile_experiment

    dims = cost.task_dims(exp)
    return compile_experiment(one_device(exp)).deterministic_executor().precast_types(dims["batch"], dims["seq"])


def delayed_history_bytes(graph) -> int:
    """Bytes of delayed fp8 scaling's amax histories in the optimizer state (replicated on every device): fp32
    [*stacked, 3, H] per fp8 weight (tessera/lower/fp8_delayed.py); 0 under any other policy."""
    import math

    from tessera.ir.passes.numerics import fp8_weights
    from tessera.lower.fp8_delayed import OPERANDS, history_length

    length = history_length(graph.attrs.get("fp8"))
    if length is None:
        return 0
    return sum(4 * len(OPERANDS) * length * math.prod(d.size for d in graph.params[path].type.dims[:lead])
               for path, lead in fp8_weights(graph).items())


def fp8_copy_bytes(exp, graph, layout: cost.Layout) -> float:
    """Bytes of the fp8 copies a train step holds of its layers' stacked fp8 weights (tessera/lower/fp8_held.py): one
    byte a weight; in deterministic mode two (both layouts the products read, `before_shards`), twice that where its
    shard loop unrolls the layers (the copies split into them too); 0 where each product quantises its own weight
    (per_block scaling, or a mesh: every fp8 mesh step is a deterministic one that gathers blocks) and without fp8
    products."""
    import math

    from tessera.ir.passes.numerics import fp8_product_dims, fp8_weight_uses
    from tessera.lower.fp8_held import DENSE, held_scaling
    from tessera.lower.shard.layerwise import unrolls

    scaling = graph.attrs.get("fp8")
    if not _trains(exp) or layout.devices != 1 or not held_scaling(scaling):
        return 0.0
    n = 0
    for op, path, name in fp8_weight_uses(graph):
        dims = graph.params[path].type.dims
        if op.name in DENSE and len(dims) > fp8_product_dims(op.name, name, op.attrs)[1]:  # stacked by a repeat
            n += math.prod(d.size for d in dims)
    if not exp.parallel.deterministic:
        return float(n)
    return float(2 * n * (2 if unrolls(_canonical(exp), scaling) else 1))


def _held(exp, graph) -> dict:
    """{path: TensorType} of the params as the program holds them: a moe's d_ff padded for packed experts."""
    from tessera.lower.options import CompileOptions
    from tessera.lower.storage import held_types

    return held_types(CompileOptions.of(exp), graph)


def _held_bytes(exp, graph) -> tuple[float, dict[str, float]]:
    """(bytes, bytes per element type) of the params as held: the IR counts, padding included."""
    by_dtype: dict[str, float] = {}
    for t in _held(exp, graph).values():
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0.0) + t.numel() * cost.bits_per_element(t.dtype) / 8
    return sum(by_dtype.values()), by_dtype


def _microbatching(exp) -> tuple[int, int]:
    """(microbatches the global batch is cut into, microbatches a pipeline stage holds at once)."""
    pp, pipe = exp.mesh.pp, exp.parallel.pipeline
    accum = getattr(exp.task, "microbatches", 1) or 1
    if pp == 1:
        return accum, 1
    in_flight = min(pp, pipe.microbatches) if pipe.schedule == "1f1b" else pipe.microbatches
    return accum * pipe.microbatches, in_flight


def run_sizes(graph, exp, train: bool) -> tuple[dict, list]:
    """(the run-time sizes the plan counts at, `cost.loss_sizes` of a model trained on its loss entries, else
    empty): a loss-entry model's `loss_model_sizes`, otherwise the task's batch and sequence."""
    losses = cost.loss_sizes(graph, exp) if graph.losses and train else []
    return (loss_model_sizes(losses) if losses else cost.task_dims(exp)), losses


def loss_model_sizes(losses: list) -> dict:
    """A loss-entry model's run-time sizes: each input dim at its largest over the entries (what the body, its
    forward pass, is walked at), `batch` the samples a step takes (collocation points over every set, or the
    data batch) and `seq` 1, so that the plan's per-token figures read per sample."""
    dims: dict[str, int] = {}
    for _, sizes in losses:
        for k, v in sizes.items():
            dims[k] = max(dims.get(k, 0), v)
    samples = sum(max(sizes.values(), default=1) for _, sizes in losses)
    return {**dims, "batch": dims.get("batch", samples), "seq": 1}


def _loss_activations(graph, exp, losses: list, layout: cost.Layout) -> float:
    """Activations a loss-entry model's train step holds: every entry's, at its inputs' sizes (a data batch cut
    into deterministic mode's canonical shards, one at a time; collocation points whole)."""
    cut = _canonical(exp) if exp.parallel.deterministic else 1
    total = 0.0
    for loss, sizes in losses:
        mb = {k: max(1, v // cut) if k == "batch" else v for k, v in sizes.items()}
        total += cost.activation_bytes(graph, mb, exp.parallel.remat, layout.activations, region=loss.region)["total"]
    return total


def activation_memory(graph, exp, sizes: dict, layout: cost.Layout, train: bool, losses: list = ()) -> dict:
    """Per-device bytes of activations (and of the KV cache when generating); `losses` (`cost.loss_sizes`): a
    model trained on its loss entries."""
    if train and losses:
        return {"activations": _loss_activations(graph, exp, list(losses), layout), "kv_cache": 0.0}
    if train:
        cut, in_flight = _microbatching(exp)
        if exp.parallel.deterministic:  # canonical shards, one at a time on each device
            cut, in_flight = _canonical(exp), 1
        mb = {**sizes, "batch": max(1, sizes["batch"] // cut)}
        acts = cost.activation_bytes(graph, mb, exp.parallel.remat, layout.activations)
        stage_layers = -(-acts["layers"] // exp.mesh.pp)
        # No buffer for the logits' cotangent: the loss's backward is one elementwise fusion of the logits (the
        # label's logit selected, not gathered: reference/losses.py), which XLA writes into the logits' own buffer.
        # Counted as one more logits-sized buffer, the plan was 11-13 % over the measured peaks (one H100, session
        # 39: 20b-layers fast 44.0 GiB against 49.6 planned, llama-1b fast 34.9 against 39.9; each had fallen by
        # one bf16 [tokens, vocab] buffer since the gather).
        per_mb = stage_layers * acts["per_layer"] + acts["total"] - acts["layers"] * acts["per_layer"]
        return {"activations": in_flight * per_mb, "kv_cache": 0.0}
    if exp.task.kind == "generate":  # the weights come split into layers (Program.init): held once
        prompt = {**sizes, "seq": sizes["seq"] - exp.task.max_new_tokens}
        kv = cost.kv_cache_bytes(graph, sizes["batch"], sizes["seq"], layout.activations)
        return {"activations": cost.working_set_bytes(graph, prompt, layout.activations), "kv_cache": kv}
    return {"activations": cost.working_set_bytes(graph, sizes, layout.activations), "kv_cache": 0.0}


def _decode_bytes(graph, layout: cost.Layout, batch: int) -> float:
    """Parameter bytes one decode step reads per device: of each param the part `batch` tokens touch."""
    total = 0.0
    for c in cost.param_counts(graph):
        touched = 1.0 - (1.0 - c.active) ** batch
        total += touched * layout.per_device(c.type) * cost.bits_per_element(c.type.dtype) / 8
    return total


def _timing(exp, graph, sizes, flops: dict, layout, device: Device, memory: dict) -> dict:
    """Implied time per step on `device` (compute bound, or bandwidth bound for decode) and the MFU ceiling."""
    n = layout.devices
    if _trains(exp):
        tokens = sizes["batch"] * sizes["seq"]
        work = flops["train_step_hardware_per_token"] * tokens / n
        t = work / device.peak_flops if device.peak_flops else None
        return {"step": "train step", "step_time_s": t, "bytes_per_step": None,
                "mfu_ceiling": flops["train_step_per_token"] / flops["train_step_hardware_per_token"]}
    if exp.task.kind == "generate":
        work = flops["forward_per_token"] * sizes["batch"] / n
        read = _decode_bytes(graph, layout, sizes["batch"]) + memory["kv_cache"]
        if not (device.peak_flops and device.bandwidth):
            return {"step": "decode step", "step_time_s": None, "bytes_per_step": read, "mfu_ceiling": None}
        t = max(work / device.peak_flops, read / device.bandwidth)
        return {"step": "decode step", "step_time_s": t, "bytes_per_step": read,
                "mfu_ceiling": work / device.peak_flops / t}
    work = flops["forward_per_token"] * sizes["batch"] * sizes["seq"] / n
    return {"step": "forward", "step_time_s": work / device.peak_flops if device.peak_flops else None,
            "bytes_per_step": None, "mfu_ceiling": 1.0}


def _flops(graph, exp, sizes: dict, losses: list = ()) -> dict:
    if losses:  # the loss entries' work, each at its inputs' sizes
        each = [cost.flop_counts(graph, s, region=loss.region) for loss, s in losses]
        counts = {k: sum(c[k] for c in each) for k in each[0]}
    else:
        counts = cost.flop_counts(graph, sizes)
    per = cost.train_flops(counts, exp.parallel.remat)
    tokens = sizes["batch"] * sizes["seq"]
    return {"forward_per_token": per["forward"] / tokens, "train_step_per_token": per["train_step"] / tokens,
            "train_step_hardware_per_token": per["train_step_hardware"] / tokens,
            "contraction_fraction": counts["contraction"] / max(per["forward"], 1.0)}


def build_plan(exp, device: str | None = None) -> dict:
    """The plan of an experiment as plain data (the `--json` schema in docs/plan.md), without compiling."""
    from tessera.ir.passes.numerics import resolved_policy
    from tessera.lower.program import program_graph

    key, dev = pick_device(device)
    graph = program_graph(exp)  # the checks `tessera check` runs (TesseraError), then the pipeline
    layout = cost.Layout.of(exp)
    train = _trains(exp)
    sizes, losses = run_sizes(graph, exp, train)
    summary = cost.param_summary(graph)  # counts: the model's (IR) parameters
    summary["bytes"], summary["bytes_by_dtype"] = _held_bytes(exp, graph)  # bytes: what the program holds
    memory = {**param_memory(graph, layout, exp, train),
              **activation_memory(graph, exp, sizes, layout, train, losses)}
    if copies := fp8_copy_bytes(exp, graph, layout):
        memory["fp8_weight_copies"] = copies
    if train and _sums_after_the_shards(exp):
        memory["released_before_the_sum"] = -min(memory["activations"], _summed_bytes(exp, graph))
    memory["total"] = sum(memory.values())
    flops = _flops(graph, exp, sizes, losses)
    step_sizes = sizes if train or exp.task.kind != "generate" else {"batch": sizes["batch"], "seq": 1}
    comms = cost.collectives(graph, step_sizes, layout, train=train, remat=exp.parallel.remat)
    timing = _timing(exp, graph, sizes, flops, layout, dev, memory)
    return {
        "schema": SCHEMA, "spec": exp.name, "model": graph.name, "task": exp.task.kind,
        "mesh": dict(exp.mesh.axes), "devices": layout.devices,
        "shapes": {**sizes, "microbatches": _microbatching(exp)[0], "remat": exp.parallel.remat,
                   "per": "sample" if losses else "token",
                   **({"inputs": {k: list(shape) for k, (shape, _) in cost.loss_inputs(losses).items()}}
                      if losses else {})},
        "params": {"total": summary["total"], "active": summary["active"], "bytes": summary["bytes"],
                   "gib": summary["bytes"] / GIB, "bytes_by_dtype": summary["bytes_by_dtype"]},
        "flops": flops,
        "memory_per_device": memory,
        "device": {"key": key, "name": dev.name, "memory_bytes": dev.memory, "peak_flops": dev.peak_flops,
                   "bandwidth_bytes_per_s": dev.bandwidth, "fits": memory["total"] <= dev.memory,
                   "margin_bytes": dev.memory - memory["total"], **timing},
        "collectives": [{"axis": r["axis"], "kind": r["kind"], "what": r["what"], "bytes_per_step": r["bytes"],
                         "step": timing["step"]} for r in comms],
        "compile": {"status": "skipped", "note": "not requested"},
        "numerics": resolved_policy(graph, exp.numerics),
        **({"pipeline": pipe} if (pipe := pipeline_record(exp, graph, layout)) else {}),
        **({"tensor": tp} if (tp := tensor_record(exp, graph, layout)) else {}),
        **({"experts": ep} if (ep := tensor_record(exp, graph, layout, "ep")) else {}),
    }


def one_device(exp):
    """A copy of `exp` on a one-device mesh (what compiles on a machine without the mesh's devices)."""
    return exp.model_copy(update={"mesh": exp.mesh.model_copy(update={a: 1 for a in exp.mesh.axes})})


# ---- command -------------------------------------------------------------------------------------------

def auto_mesh(exp, device: str | None = None, devices: int | None = None):
    """(exp on the mesh `mesh: auto` picks, the choice's record or None when the mesh is explicit): among
    `devices` (default this machine's) of the named device's memory at the allocator's 95 %, or this
    machine's usable memory when none is named."""
    if not exp.mesh.auto or exp.mesh.size > 1:
        return exp, None
    import jax

    from tessera.run.automesh import choose_mesh, usable_memory
    from tessera.run.environment import ALLOCATOR_FRACTION

    if device is None:
        memory, present, _ = usable_memory()
    else:
        memory, present = float(ALLOCATOR_FRACTION) * pick_device(device)[1].memory, len(jax.devices())
    choice = choose_mesh(exp, devices or present, memory)
    return choice.exp, choice.record()


def plan_command(spec, overrides=(), as_json: bool = False, device: str | None = None,
                 compile_check: bool = True, devices: int | None = None) -> int:
    """Print the plan of SPEC (a table, or JSON); exit 0, or 1 when the ahead-of-time compile fails."""
    from tessera.spec import load_experiment

    exp = load_experiment(spec, overrides=list(overrides or ()))
    started = time.perf_counter()
    exp, choice = auto_mesh(exp, device, devices)
    plan = build_plan(exp, device)
    if choice is not None:
        plan["mesh_choice"] = choice
    if compile_check:
        from tessera.run.plan_compile import aot_compile

        plan["compile"] = aot_compile(exp, plan)
    plan["seconds"] = time.perf_counter() - started
    if as_json:
        print(json.dumps(plan, indent=2, sort_keys=False))
    else:
        from tessera.run.plan_text import render

        render(plan, sys.stdout)
    return 1 if plan["compile"]["status"] == "failed" else 0
