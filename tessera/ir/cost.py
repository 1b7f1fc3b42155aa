"""Counting from the Graph IR: parameters (total, active, bytes), FLOPs, activation and KV-cache bytes.

Everything here walks a graph; nothing is a per-model formula. Ops inside `repeat(n, ...)` count n times
(their params are stored stacked, so a param's numel already includes the layers). Per-device figures take
a `per_device(type) -> elements` function: a `Layout`, the shard pass's AxisRules counted per device.
Assumptions:

- active parameters: what one token's forward pass multiplies by, each op's `OpDef.active_fraction`. The
  embedding table is a lookup (one row), norm scales are per-channel scales (the published GPT-OSS counts
  leave both out), a MoE reads top_k of its experts plus its router; every other parameter is read whole.
- a training step is forward + backward; backward costs 2x forward for contractions (`OpDef.contraction`: a
  gradient for the input and one for the weight) and 1x forward for everything else, over the steps it
  differentiates (a loop at its cap; under `grad = last` only the last step of a recurrence). Rematerialisation
  recomputes the forward of the repeated block: all of it (`full`) or its non-contraction ops (`dots`).
"""

from __future__ import annotations

import dataclasses
import math

from tessera.grammar.numerics import BASE_TYPES, NumericType, block_scaled, block_scaled_bits
from tessera.ir.flops import op_flops
from tessera.ir.ops_nn import CACHE_BLOCK, cache_len  # noqa: F401  (the cache's slots: beside attention's state)
from tessera.ir.passes.shard import AxisRules
from tessera.ir.registry import get_op
from tessera.ir.types import Dim, Graph, Op, ParamRef, Region, TensorType
from tessera.ir.verify import owns_params, split_operands

# ---- element sizes ----------------------------------------------------------------------------------

_IR_TO_NUMERIC = {"f32": "fp32", "f16": "fp16", "fp8": "fp8_e4m3"}
_PLAIN_BITS = {"f64": 64, "i64": 64, "i32": 32, "i8": 8, "u8": 8, "bool": 8, "c64": 64, "c128": 128}


def bits_per_element(dtype: str) -> float:
    """Storage bits of one element of an IR element type (mxfp4 = 4.25: 4 bits + an 8-bit scale per 32;
    fp8_e4m3_b128 = 8 + 32/128²: a byte each + an fp32 scale per 128×128 block)."""
    if block_scaled(dtype):
        return block_scaled_bits(dtype)
    base = _IR_TO_NUMERIC.get(dtype, dtype)
    if base in BASE_TYPES:
        return NumericType(base).bits_per_element
    if dtype in _PLAIN_BITS:
        return float(_PLAIN_BITS[dtype])
    raise ValueError(f"element type `{dtype}` has no known size")


def nbytes(t: TensorType, numel: float | None = None) -> float:
    """Bytes of a tensor of type `t` (all dims sized), or of `numel` elements of its element type."""
    n = t.numel() if numel is None else numel
    return n * bits_per_element(t.dtype) / 8.0


def concrete(t: TensorType, sizes: dict) -> TensorType:
    """`t` with its run-time dims (batch, seq) sized from `sizes`."""
    dims = tuple(d if d.size is not None else Dim(d.name, sizes[d.name]) for d in t.dims)
    return TensorType(t.dtype, dims, t.shard)


def shape_at(t: TensorType, sizes: dict) -> tuple[int, ...]:
    """The shape of `t` with its run-time dims sized from `sizes`."""
    return tuple(d.size for d in concrete(t, sizes).dims)


# ---- task sizes ---------------------------------------------------------------------------------------

def _prompt_len(prompt) -> int:
    return len(prompt.encode()) if isinstance(prompt, str) else len(prompt)


def task_dims(exp) -> dict[str, int]:
    """The run-time sizes {"batch", "seq"} of the spec's task (generate: prompts + new tokens; collocation points:
    every set's points as the batch, seq 1, and `points`, the largest set's)."""
    task = exp.task
    data = getattr(task, "data", None)
    if getattr(data, "kind", None) == "collocation":  # points, not sequences: every set's, the largest set's
        counts = [int(spec.n) for spec in data.sets.values()]
        return {"batch": sum(counts), "seq": 1, "points": max(counts)}
    if task.kind in ("train", "bench"):
        return {"batch": task.batch, "seq": task.seq_len}
    if task.kind == "generate":
        longest = max(_prompt_len(p) for p in task.prompts)
        return {"batch": len(task.prompts), "seq": longest + task.max_new_tokens}
    if task.tokens is not None:  # forward
        return {"batch": len(task.tokens), "seq": len(task.tokens[0])}
    import numpy as np

    shape = np.load(task.tokens_file, mmap_mode="r").shape
    return {"batch": int(shape[0]), "seq": int(shape[1])}


def loss_sizes(graph: Graph, exp) -> list[tuple]:
    """(loss entry, its inputs' run-time dim sizes) for each loss entry of a model trained on batches of data: a
    collocation set's points for an input named after the set (or its `<set>_target`), the task's batch of
    samples for any other input. The per-device work of a canonical shard is the caller's to divide."""
    data = getattr(exp.task, "data", None)
    out = []
    for loss in graph.losses:
        sizes: dict[str, int] = {}
        for arg in loss.region.args:
            rows = _input_rows(arg.name, data, exp.task)
            for d in arg.type.dims:
                if d.size is None:
                    sizes[d.name] = rows
        out.append((loss, sizes))
    return out


def loss_inputs(losses: list) -> dict[str, tuple[tuple[int, ...], str]]:
    """{input name: (shape, IR element type)} of the loss entries' inputs at their `loss_sizes`."""
    return {a.name: (shape_at(a.type, sizes), a.type.dtype)
            for loss, sizes in losses for a in loss.region.args}


def _input_rows(name: str, data, task) -> int:
    if getattr(data, "kind", None) == "collocation":
        sets = data.sets
        return int(sets[name if name in sets else name.removesuffix("_target")].n)
    return int(task.batch)


# ---- walking ------------------------------------------------------------------------------------------

def _inner(op: Op, axes: tuple, backward: bool = False):
    """(region, the repeat axes inside it, how many times it runs per run of `op`, the name scope of its ops) for
    each region of a region op that runs in the forward pass: a loop's twice (its condition under `until`).
    `backward`: how many runs the backward pass differentiates instead (one under `grad = last`; no condition)."""
    opdef = get_op(op.name)
    runs = opdef.runs(op.attrs)
    if backward:
        runs = (runs[0] if opdef.kept is None else opdef.kept(op.attrs), 0)
    scopes = (op.scope_name, f"{op.scope_name}/{get_op(op.name).second}")
    for region, inner, n, scope in zip((op.region, op.second), (axes + tuple(op.stacking), axes), runs, scopes):
        if region is not None and n:
            yield region, inner, n, scope


def walk_counted(region: Region, axes=(), times: int = 1, backward: bool = False):
    """(op, repeat axes around it, how many times it runs) for every op outside of a region op, depth first; a
    loop's ops count at its cap. `backward`: how many times the backward pass differentiates it."""
    for op in region.ops:
        if op.region is not None:
            for inner, inner_axes, n, _ in _inner(op, tuple(axes), backward):
                yield from walk_counted(inner, inner_axes, times * n, backward)
        else:
            yield op, tuple(axes), times


def walk_labeled(region: Region, axes=(), times: int = 1, scope: str = ""):
    """(label, op, repeat axes around it, how many times it runs) for every op outside of a region op; the label is
    the name scope the lowering traces the op under (`Op.label`), so profiles and the plan meet on it."""
    for index, op in enumerate(region.ops):
        if op.region is not None:
            for inner, inner_axes, n, inner_scope in _inner(op, tuple(axes)):
                yield from walk_labeled(inner, inner_axes, times * n, inner_scope)
        else:
            yield op.label(index, scope), op, tuple(axes), times


def param_uses(op: Op) -> list[tuple[str, str | None]]:
    """(path, local name the op declares for it or None) of each param the op reads."""
    opdef = get_op(op.name)
    refs = [o for o in op.operands if isinstance(o, ParamRef)]
    if not refs:
        return []
    if not owns_params(opdef):  # a primitive reading a param as data (`dot(%x, @w)`)
        return [(r.path, None) for r in refs]
    data, owned = split_operands(op, opdef)
    decls = opdef.params(op.attrs, [o.type for o in data])
    names = {id(ref): d.name for d, ref in zip(decls, owned)}
    return [(r.path, names.get(id(r))) for r in refs]


# ---- parameters ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ParamCount:
    """One parameter: its type (stacked), numel, the fraction a token reads, bytes in its storage type."""

    path: str
    type: TensorType
    numel: int
    active: float  # fraction in [0, 1]

    @property
    def bytes(self) -> float:
        return nbytes(self.type)


def param_counts(graph: Graph) -> list[ParamCount]:
    """Every parameter with its active fraction (the largest over the ops that read it)."""
    fraction: dict[str, float] = {}
    for op, _, _ in walk_counted(graph.body):
        rule = get_op(op.name).active_fraction
        for path, name in param_uses(op):
            fraction[path] = max(fraction.get(path, 0.0), rule(op.attrs, name))
    return [ParamCount(p.path, p.type, p.type.numel(), fraction.get(p.path, 0.0)) for p in graph.params.values()]


def param_summary(graph: Graph) -> dict:
    """{"total", "active"} parameter counts and {"bytes"} in storage types, plus bytes per element type."""
    counts = param_counts(graph)
    by_dtype: dict[str, float] = {}
    for c in counts:
        by_dtype[c.type.dtype] = by_dtype.get(c.type.dtype, 0.0) + c.bytes
    return {"total": sum(c.numel for c in counts), "active": round(sum(c.numel * c.active for c in counts)),
            "bytes": sum(c.bytes for c in counts), "bytes_by_dtype": by_dtype}


# ---- FLOPs --------------------------------------------------------------------------------------------

def flop_counts(graph: Graph, sizes: dict, region: Region | None = None) -> dict[str, float]:
    """Forward FLOPs split into contractions / other; those the backward pass differentiates (all of them but the
    steps before the last under `grad = last`), and of those the ones in the repeated block (what remat
    recomputes). Of the graph's body, or of `region` (a loss entry's)."""
    out = {"contraction": 0.0, "other": 0.0, "backward_contraction": 0.0, "backward_other": 0.0,
           "block_contraction": 0.0, "block_other": 0.0}
    for backward in (False, True):
        for op, axes, times in walk_counted(region or graph.body, backward=backward):
            f = times * op_flops(op, graph, sizes, list(axes))
            kind = "contraction" if get_op(op.name).contraction else "other"
            out[("backward_" if backward else "") + kind] += f
            if axes and backward:
                out["block_" + kind] += f
    return out


def train_flops(counts: dict[str, float], remat: str = "none") -> dict[str, float]:
    """Model FLOPs of forward + backward, and hardware FLOPs including the remat recompute."""
    fwd = counts["contraction"] + counts["other"]
    model = fwd + 2.0 * counts["backward_contraction"] + counts["backward_other"]
    recompute = {"none": 0.0, "dots": counts["block_other"],
                 "full": counts["block_contraction"] + counts["block_other"]}[remat]
    return {"forward": fwd, "train_step": model, "train_step_hardware": model + recompute}


def flops_per_token(graph: Graph, exp) -> dict[str, float]:
    """Forward, training-step and training-step-with-recompute FLOPs per token at the task's shapes."""
    return token_flops(graph, task_dims(exp), exp.parallel.remat)


def token_flops(graph: Graph, sizes: dict[str, int], remat: str) -> dict[str, float]:
    """`flops_per_token` at run-time sizes {"batch", "seq"} under rematerialisation policy `remat`."""
    per = train_flops(flop_counts(graph, sizes), remat)
    return {k: v / (sizes["batch"] * sizes["seq"]) for k, v in per.items()}


def graph_flops_per_token(graph: Graph, exp) -> float:
    """Forward FLOPs per token at the task's batch and sequence length, counted from the graph."""
    return flops_per_token(graph, exp)["forward"]


# ---- activations saved for backward ---------------------------------------------------------------------

def saved_tensors(op: Op, sizes: dict, internals: str = "all") -> list[tuple[TensorType, bool]]:
    """Tensors `op` keeps for backward at `sizes`, each with whether it is a contraction's output: its results plus a
    composite's internals (`OpDef.saved`): all of them, or (`internals="contractions"`) only its products."""
    opdef = get_op(op.name)
    out = [(concrete(r.type, sizes), opdef.contraction) for r in op.results]
    if opdef.saved is not None:
        out += [x for x in opdef.saved(concrete(op.values[0].type, sizes), op.attrs)
                if internals == "all" or x[1]]
    return out


def activation_bytes(graph: Graph, sizes: dict, remat: str, per_device=lambda t: t.numel(),
                     region: Region | None = None) -> dict[str, float]:
    """Bytes of activations held for backward: per layer under `remat`, the block inputs, the rest of the graph
    (its body, or `region`: a loss entry's).

    none: each op's results and products, what the lowering's policy keeps in fast mode (tessera/lower/interpret.py
    KEEP_RESULTS): a composite's other internals (the MLP's activation, an fp32 upcast, a norm's statistics) are
    recomputed by its backward. Deterministic mode keeps JAX's own residuals, near this (docs/plan.md).
    dots: only contraction outputs of each layer. full: each layer's input only, plus one layer's full set while
    that layer's backward recomputes it.
    """
    def size(items):
        return sum(nbytes(t, per_device(t)) for t, _ in items)

    outside, blocks, whole = 0.0, [], 0.0  # blocks: (runs kept, kept under none, contraction outputs, inputs)
    for op in (region or graph.body).ops:
        if op.region is None:
            outside += size(saved_tensors(op, sizes))
            continue
        carry = sum(nbytes(t, per_device(t)) for t in (concrete(v.type, sizes) for v in op.values))
        items = [x for o, _, _ in walk_counted(op.region) for x in saved_tensors(o, sizes, "contractions")]
        blocks.append((_kept(op), size(items), size([x for x in items if x[1]]), carry))
        whole = max(whole, size([x for o, _, _ in walk_counted(op.region) for x in saved_tensors(o, sizes)]))
    per = [{"none": a, "dots": d + c, "full": c}[remat] for _, a, d, c in blocks]
    peak_extra = whole if remat == "full" else 0.0
    if len(blocks) == 1:  # a language model's layer stack: per layer, times its layers
        layers, per_layer = blocks[0][0], per[0]
    else:  # several region ops (a loss entry's network and its derivatives): each at its own count
        layers, per_layer = 1, sum(k * p for (k, _, _, _), p in zip(blocks, per))
    return {"per_layer": per_layer, "layers": layers, "outside_block": outside,
            "total": layers * per_layer + peak_extra + outside}


def _kept(op: Op) -> int:
    """How many runs of a region op's region keep activations for backward: every one, or one (`grad = last`)."""
    opdef = get_op(op.name)
    return opdef.kept(op.attrs) if opdef.kept is not None else opdef.runs(op.attrs)[0]


def working_set_bytes(graph: Graph, sizes: dict, per_device=lambda t: t.numel()) -> float:
    """Inference activations: one layer's tensors live at once, plus the largest tensor outside the block."""
    layer = outside = 0.0
    for op in graph.body.ops:
        if op.region is not None:
            items = [x for o, _, _ in walk_counted(op.region) for x in saved_tensors(o, sizes)]
            layer = max(layer, sum(nbytes(t, per_device(t)) for t, _ in items))
        else:
            outside = max([outside] + [nbytes(t, per_device(t)) for t, _ in saved_tensors(op, sizes)])
    return layer + outside


# ---- KV cache -----------------------------------------------------------------------------------------

def kv_cache_bytes(graph: Graph, batch: int, max_len: int, per_device=lambda t: t.numel()) -> float:
    """Bytes of every attention op's KV cache for `batch` sequences of up to `max_len` tokens.

    Each cache holds k and v [batch, C, kv_heads, head_dim] in the op's compute type and int32 positions
    [batch, C]; C = cache_len(max_len, window).
    """
    return sum(op_kv_cache_bytes(op, times, batch, max_len, per_device) for op, _, times in walk_counted(graph.body))


def op_kv_cache_bytes(op: Op, times: int, batch: int, max_len: int, per_device=lambda t: t.numel()) -> float:
    """Bytes of the state one op keeps between decode steps (`OpDef.state`: an attention's KV caches) over
    the `times` layers it runs in; 0 for an op that keeps none."""
    rule = get_op(op.name).state
    if rule is None:
        return 0.0
    variants = rule(op.attrs, op.result.type.dtype, batch, max_len)  # one per layer variant (window)
    return sum(nbytes(t, per_device(t)) for tensors in variants for t in tensors) * times / len(variants)


# ---- layout on the mesh ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layout:
    """How each named dim of a tensor splits over the mesh: the shard pass's `AxisRules`, counted per device."""

    rules: AxisRules

    @classmethod
    def of(cls, exp) -> "Layout":
        """The layout of an experiment's mesh and `parallel.rules`."""
        return cls(AxisRules.from_experiment(exp))

    @classmethod
    def single(cls) -> "Layout":
        """One device: nothing is split."""
        return cls(AxisRules((), ()))

    @property
    def mesh(self) -> dict[str, int]:
        return dict(self.rules.sizes)

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    def split(self, t: TensorType, activation: bool = False) -> dict[str, tuple[str, ...]]:
        """dim name -> the mesh axes that split it (only dims that are split)."""
        return {n: a for n, a in zip(t.names, self.rules.dims(t.names, activation=activation)) if a}

    def per_device(self, t: TensorType, activation: bool = False) -> float:
        """Elements of `t` one device holds."""
        split = self.split(t, activation)
        return float(math.prod(-(-d.size // self.rules.size(split.get(d.name, ()))) for d in t.dims))

    def activations(self, t: TensorType) -> float:
        """Elements of activation `t` one device holds (model dims whole, sequence parallelism applied)."""
        return self.per_device(t, activation=True)


# ---- collectives ----------------------------------------------------------------------------------------

def _ring(kind: str, n: int, full: float) -> float:
    """Bytes one device sends for a ring collective over n devices on a tensor of `full` bytes."""
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n * full


def param_collectives(graph: Graph, layout: Layout, train: bool, grad_bits: float = 32.0) -> list[tuple]:
    """Parameter all-gathers over axes that split both params and the batch (fsdp), gradient reductions."""
    rows = []
    for p in graph.params.values():
        used = {a for axes in layout.split(p.type).values() for a in axes}
        local = layout.per_device(p.type)  # elements this device stores
        for a in layout.rules.axes("batch"):
            n = layout.mesh[a]
            if a in used:  # stored sharded, gathered for use: forward (and again in backward)
                gathered = nbytes(p.type, local * n)
                rows.append((a, "all-gather", "parameters", (2 if train else 1) * _ring("all-gather", n, gathered)))
                if train:
                    rows.append((a, "reduce-scatter", "gradients", _ring("reduce-scatter", n, local * n * grad_bits / 8)))
            elif train:
                rows.append((a, "all-reduce", "gradients", _ring("all-reduce", n, local * grad_bits / 8)))
    return rows


def _op_collectives(op: Op, axes, times: int, graph: Graph, sizes: dict, layout: Layout, passes: float):
    """Activation collectives of one op: all-reduce of outputs contracted over split dims, expert all-to-all."""
    from tessera.ir.verify import param_type

    rows = []
    out = concrete(op.result.type, sizes)
    skip = set(layout.rules.axes("batch")) | {"pp"}
    reduce_dims: dict[str, str] = {}
    for path, _ in param_uses(op):
        t = param_type(graph, path, list(axes))
        for dim, mesh_axes in layout.split(t).items():
            for a in mesh_axes:
                if a not in skip and out.dim(dim) is None:
                    reduce_dims.setdefault(a, dim)
    for a, dim in reduce_dims.items():
        n = layout.mesh[a]
        if dim == "experts":  # each token's top_k copies go to their experts' devices and come back
            x = concrete(op.values[0].type, sizes)
            copies = nbytes(x, layout.activations(x)) * op.attrs.get("top_k", 1)
            rows.append((a, "all-to-all", f"{op.name} tokens", passes * times * 2 * _ring("all-to-all", n, copies)))
        else:  # with sequence parallelism the all-reduce is a reduce-scatter then an all-gather: same bytes
            kind = "reduce-scatter+all-gather" if layout.rules.sequence_parallel else "all-reduce"
            rows.append((a, kind, f"{op.name} output",
                         passes * times * _ring("all-reduce", n, nbytes(out, layout.activations(out)))))
    gather = get_op(op.name).seq_gather  # tensors of the whole sequence, gathered over context-parallel axes
    if gather is not None:
        ins = [concrete(v.type, sizes) for v in op.values]
        for a in layout.rules.context_axes():
            n = layout.mesh.get(a, 1)  # each device's block of the sequence, gathered into n blocks
            if n == 1:
                continue
            whole = sum(n * nbytes(t, layout.activations(t)) for t in gather(op.attrs, ins, out.dtype))
            rows.append((a, "all-gather", f"{op.name} keys, values", passes * times * _ring("all-gather", n, whole)))
    return rows


def collectives(graph: Graph, sizes: dict, layout: Layout, *, train: bool, remat: str = "none") -> list[dict]:
    """Bytes each device sends per step, per (mesh axis, collective, what), from the graph at `sizes`.

    Ring algorithms: all-reduce 2(n-1)/n of the tensor, all-gather / reduce-scatter / all-to-all (n-1)/n.
    Activation collectives run once per forward; a training step has forward + backward (+ the forward
    again under `full` remat). Pipeline stages pass the block's carry forward (and its gradient back).
    """
    passes = (3.0 if remat == "full" else 2.0) if train else 1.0
    rows = param_collectives(graph, layout, train)
    for op, axes, times in walk_counted(graph.body):
        rows += _op_collectives(op, axes, times, graph, sizes, layout, passes)
    pp = layout.mesh.get("pp", 1)
    if pp > 1:
        for op in graph.body.ops:
            if op.region is not None:
                carry = sum(nbytes(t, layout.activations(t)) for t in (concrete(v.type, sizes) for v in op.values))
                rows.append(("pp", "send/recv", "stage activations", (2.0 if train else 1.0) * carry))
    merged: dict[tuple, float] = {}
    for axis, kind, what, b in rows:
        merged[(axis, kind, what)] = merged.get((axis, kind, what), 0.0) + b
    return [{"axis": a, "kind": k, "what": w, "bytes": b} for (a, k, w), b in merged.items() if b > 0]
