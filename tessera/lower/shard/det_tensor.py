"""Deterministic tensor parallelism: the contractions tp splits computed as canonical chunk trees on every mesh.

Issue 36's tp compute split (docs/parallel.md, "Deterministic tp"), behind `parallel.canonical_tp = T`. Fast mode's
tensor parallelism (Megatron's f and g) sums partial products with `psum`, whose order is the collective's and
depends on the device count. Here a contraction that tp splits is computed on every mesh, one device included, as T
canonical chunk products summed in `tree_sum`'s balanced tree. A device of a tp group of t holds the chunks
i·T/t … (i+1)·T/t − 1 (tp splits the weight's dim in device order), one aligned subtree of that tree: it sums them
locally, and the t subtree sums meet in `ordered_sum` (device order): the very adds of one device's tree.

- `reduce_chunks`: a row-parallel product's forward (attention's output projection over heads, an MLP's or the
  experts' down projection over their hidden dim): the chunks' partial outputs [k, ...] summed;
- `fan_out`: a column-parallel product's backward (q/k/v over heads, gate/up over the hidden dim): its input reaches
  the k chunk products through it, and its VJP sums the k cotangents the same way;
- `per_chunk`: attention's core on each chunk of heads as a computation of its own (its backward is not the same
  bits on a slice of the heads as inside all of them, on XLA:CPU);
- `plan` and `tensor_grads`: where the train step splits the compute over tp, and that step; the same for ep, whose
  operators are det_expert.py's (`parallel.canonical_ep`: the experts in canonical chunks).

Splitting a dim that a plain product does not contract does not change its bits on XLA:CPU (each chunk's product on
one device and on its tp device is the same batched product over fewer batch entries: tests/lower/shard/
test_det_tensor.py), so everything else in a block is the one device's arithmetic on a slice.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from tessera.ir.types import ParamRef
from tessera.lower import precast
from tessera.lower.fence import fenced
from tessera.lower.shard import layerwise
from tessera.lower.shard.collectives import block_index
from tessera.lower.shard.deterministic import ordered_sum, shard_gradients, tree_sum


def _across(x, axes: tuple):
    return ordered_sum(x, axes) if axes else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_chunks(parts, axes: tuple = ()):
    """The sum of the canonical chunks' partial products: `parts` [k, ...] this device's k chunks, `axes` the mesh
    axes the chunks are split over (empty on one device, where k = T). Forward: tree_sum over the k, then the devices'
    sums in device order (`ordered_sum`), on every device alike. Backward: each chunk's cotangent is the sum's."""
    return _across(tree_sum(parts), axes)


def _reduce_fwd(parts, axes):
    return reduce_chunks(parts, axes), parts.shape[0]


def _reduce_bwd(axes, k, g):
    return (jnp.broadcast_to(g, (k,) + g.shape),)


reduce_chunks.defvjp(_reduce_fwd, _reduce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fan_out(x, k: int, axes: tuple = ()):
    """x for each of this device's k canonical chunk products: [k, ...] (a broadcast). Backward: the k chunks'
    cotangents summed in `tree_sum`'s tree, then the devices' sums in device order over `axes`: the gradient of x is
    the same tree over all T chunks on every mesh, where autodiff of k separate uses would add them in its own order
    and fast mode's psum in the collective's."""
    return jnp.broadcast_to(x, (k,) + x.shape)


def _fan_fwd(x, k, axes):
    return fan_out(x, k, axes), None


def _fan_bwd(k, axes, _, g):
    return (_across(tree_sum(g), axes),)


fan_out.defvjp(_fan_fwd, _fan_bwd)


def per_chunk(fn, k: int, q, kk, v, sinks):
    """Attention by chunks of heads: q [B, S, H, D], kk and v [B, S, KV, D] and sinks [H] (or None) cut into k chunks
    of heads, fn(q, k, v, sinks) of each chunk as a computation of its own (`fenced`), the outputs joined [B, S, H,
    D]. XLA:CPU's attention backward is not the same bits on a slice of the heads as inside all of them (the query
    and key gradients of heads 2-3 of 4 computed alone differed, fp32), so each chunk is attended alone on every
    mesh, one device included: the same computation on the same shapes."""
    sink_parts = [None] * k if sinks is None else list(chunked(sinks, 0, k))
    outs = [fenced(fn, qj, kj, vj, sj) for qj, kj, vj, sj in zip(chunked(q, 2, k), chunked(kk, 2, k), chunked(v, 2, k),
                                                                  sink_parts)]
    return unchunked(jnp.stack(outs), 2)


def chunked(w, dim: int, k: int):
    """w with its dim `dim` cut into k equal chunks, the chunk index first: [k, ...] (dim then holds size/k)."""
    if w.shape[dim] % k:
        raise ValueError(f"dim {dim} of {w.shape} does not split into {k} canonical chunks")
    shape = w.shape[:dim] + (k, w.shape[dim] // k) + w.shape[dim + 1:]
    return jnp.moveaxis(w.reshape(shape), dim, 0)


def unchunked(w, dim: int):
    """`chunked`'s inverse: [k, ...] back to one dim `dim` of k times the size."""
    w = jnp.moveaxis(w, 0, dim)
    return w.reshape(w.shape[:dim] + (w.shape[dim] * w.shape[dim + 1],) + w.shape[dim + 2:])


# ---- the train step whose tp splits the layers' compute ----------------------------------------------------------

TP, EP = "tp", "ep"
# the ops whose lowerings compute by a group axis' canonical chunks (tessera/lower/ops_nn.py): tp's heads and hidden
# dims, ep's experts (tessera/lower/shard/det_expert.py)
CHUNKED_OPS = {TP: ("attention", "mlp", "moe"), EP: ("moe",)}
SPEC_KEY = {TP: "parallel.canonical_tp", EP: "parallel.canonical_ep"}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where deterministic tp and ep split compute: `groups` {axis: (devices, canonical chunks)} of the axes that split
    it (tp, ep; mesh order), `data_axes` the other axes > 1 (mesh order), `chunked` {path: the group axes it is split
    over and read split by their chunked ops (each device computes with its slice)} and `whole` {path: the group axes
    it is split over but gathered whole and computed alike on every device of the group (e.g. a vocab-split embedding
    table, the router of ep-split experts)}."""
    groups: dict
    data_axes: tuple[str, ...]
    chunked: dict
    whole: dict

    def slice_of(self, path: str) -> int:
        """How many devices share the path's parameter as they compute: its chunked axes' sizes multiplied."""
        return math.prod(self.groups[a][0] for a in self.chunked.get(path, ()))


def _readers(region, out: dict) -> dict[str, set[str]]:
    """{parameter path: the names of the ops that read it}, nested regions included."""
    for op in region.ops:
        for o in op.operands:
            if isinstance(o, ParamRef):
                out.setdefault(o.path, set()).add(op.name)
        for r in (op.region, op.second):
            if r is not None:
                _readers(r, out)
    return out


def _axis_plan(graph, shapes: dict, mesh_shape: dict, param_specs: dict, chunks: int, axis: str, readers: dict):
    """({path: "chunked" | "whole"} of the parameters split over `axis`, "") where `axis` can split the compute on
    its own terms (the C condition is the layout's), else (None, why it acts as a data axis)."""
    tp = mesh_shape.get(axis, 1)
    key = SPEC_KEY[axis]
    if tp <= 1:
        return None, f"no {axis} axis"
    if chunks <= 1:
        what = "the attention, MLP and expert compute" if axis == TP else "the experts' compute"
        return None, (f"{key} is not set (a multiple of {axis}, e.g. {tp}, splits {what} over {axis}; like "
                      "canonical_shards it is part of the numbers)")
    if chunks % tp:
        return None, f"{key} = {chunks} is not a multiple of {axis} = {tp}"
    if graph.losses:
        return None, "a model with loss entries"
    kinds = {}
    for path, spec in param_specs.items():
        dims = layerwise.entries_with(spec, axis)
        if not dims:
            continue
        if len(dims) > 1 or tuple(spec)[dims[0]] != axis:
            return None, f"{path} is split over {axis} together with another axis"
        # ep: the experts' own matrices and biases; the router (its experts dim split too) routes whole
        if readers.get(path) and readers[path] <= set(CHUNKED_OPS[axis]) and (axis != EP or "/experts/" in path):
            if shapes[path].shape[dims[0]] % chunks:
                return None, f"{path}'s dim {dims[0]} ({shapes[path].shape[dims[0]]}) does not split into {chunks} chunks"
            kinds[path] = "chunked"
        else:
            kinds[path] = "whole"
    if "chunked" not in kinds.values():
        what = "attention, MLP or expert" if axis == TP else "expert"
        return None, f"no {what} parameter is split over {axis}"
    return kinds, ""


def plan(graph, shapes: dict, mesh_shape: dict, param_specs: dict, c: int, chunks: dict,
         pipeline=None) -> tuple[Layout | None, dict]:
    """(Layout or None, {axis: why it acts as a data axis, "" where it splits}) of the deterministic train step on
    this mesh: tp splits attention, MLP and the experts' hidden dims, ep the experts, each where its
    `chunks[axis]` (parallel.canonical_tp / canonical_ep) allows, both together where both do (the expert products
    then by chunk of experts and, inside each, by chunk of the hidden dim). Only axes of the mesh get a why.
    `pipeline` (det_pipeline.Layout, where pp splits the layers): the chunks run inside each stage's layers, pp is
    then no data axis, and a parameter read split must be a layer's (the stages compute the ends whole)."""
    readers = _readers(graph.body, {})
    if pipeline is not None:
        mesh_shape = {a: n for a, n in mesh_shape.items() if a != "pp"}
    axes = [a for a in mesh_shape if a in (TP, EP) and mesh_shape[a] > 1]
    kinds, why = {}, {}
    for a in axes:
        kinds[a], why[a] = _axis_plan(graph, shapes, mesh_shape, param_specs, int(chunks.get(a) or 1), a, readers)
        ends = sorted(p for p, kind in (kinds[a] or {}).items() if kind == "chunked" and pipeline is not None
                      and p in pipeline.pre_reads | pipeline.post_reads)
        if ends:
            why[a] = f"{ends[0]} is read split outside the layers, which the pipeline's ends compute whole"
            kinds[a] = None
    groups = [a for a in axes if kinds[a] is not None]
    if not groups:
        return None, why
    data_axes = tuple(a for a, n in mesh_shape.items() if n > 1 and a not in groups)
    n_d = math.prod(mesh_shape[a] for a in data_axes)
    if c % n_d or (c // n_d) & (c // n_d - 1):
        return None, {**why, **{a: f"C = {c} over {n_d} data devices is not a power of two of shards each"
                                for a in groups}}
    chunked, whole = {}, {}
    for a in groups:
        for path, kind in kinds[a].items():
            into = chunked if kind == "chunked" else whole
            into[path] = into.get(path, ()) + (a,)
    layout = Layout({a: (mesh_shape[a], int(chunks[a])) for a in groups}, data_axes, chunked, whole)
    return layout, why


def gathers(det, layout: Layout | None, data_axes: tuple[str, ...]):
    """gather(path, held) -> the parameter as this device computes with it, its VJP summing the data devices' block
    gradients in device order: gathered over `data_axes` and the mesh axes the layout does not read it split over
    (its own tp or ep slice kept), and where it is computed whole on every device of a group, that device's block of
    the cotangent kept along the group's axis."""
    specs, sizes = det.param_specs, dict(det.mesh.shape)

    def gather(k, held):
        spec = specs[k]
        for a in (layout.chunked.get(k, ()) if layout is not None else ()):  # read split: its slice stays
            spec = layerwise.without(spec, a)
        own = layout.whole.get(k, ()) if layout is not None else ()
        return layerwise.gather_at_use(held, spec, len(det.whole_shapes[k]), data_axes, sizes, own=own)

    return gather


def device_chunks(layout: Layout | None) -> dict:
    """This device's chunks as `Program.logits` and `lower_ctx` take them: {tensor: (T / tp, (tp,)), experts:
    (first, Q / ep, Q, (ep,))} for the layout's group axes (inside shard_map: ep's first chunk is its place)."""
    out = {}
    if layout is not None and TP in layout.groups:
        t, total = layout.groups[TP]
        out["tensor"] = (total // t, (TP,))
    if layout is not None and EP in layout.groups:
        e, total = layout.groups[EP]
        out["experts"] = (jax.lax.axis_index(EP) * (total // e), total // e, total, (EP,))
    return out


def tensor_grads(det, layout: Layout, params: dict, batch: dict, c: int, ls, narrow: dict):
    """`Deterministic._per_layer_grads`' results (this device's gradient blocks summed over all C shards; per-shard
    loss sums and counts in canonical order; no terms, no amaxes) with tp splitting the attention and MLP compute.
    The devices of a tp group run the same canonical shards (the data axes share them as in the per-layer step:
    data device d the shards j·n_d + d); each computes its own chunks of the tp-split contractions
    (LowerCtx.tensor = (T / tp, ("tp",))), its chunked parameters gathered over the data axes only and the rest whole.
    Inside the train step's shard_map."""
    specs, sizes, D = det.param_specs, dict(det.mesh.shape), layout.data_axes
    n_d = math.prod(sizes[a] for a in D)
    m = c // n_d
    cast, held, unroll = precast.cast(params, narrow), params, det.unrolls(c)
    if unroll:  # each layer's weights their own buffers, split once here (layerwise.py)
        cast, held = (layerwise.split(t, det.stacked) for t in (cast, params))

    gather = gathers(det, layout, D)
    at_use = det.at_use
    chunks = device_chunks(layout)

    def scaled(p, sh):
        p = {k: layerwise.held(v, cast[k] if k in narrow else None) if k in specs else v for k, v in p.items()}
        p = {k: layerwise.each(functools.partial(gather, k), v) if k in specs and k not in at_use else v
             for k, v in p.items()}
        hooks = {k: functools.partial(gather, k) for k in at_use}
        s, count, terms = det.shard_sums(p, sh, param_use=hooks, unroll=unroll, **chunks)
        return (s if ls is None else s * ls.scale), (count, terms)

    # this data device's shards j·n_d + d, j < m, of the batch (held in blocks over every axis): [m, rows, ...]
    every = tuple(a for a, n in sizes.items() if n > 1)
    d = block_index(D) if D else 0

    def mine(a):
        whole = jax.lax.all_gather(a, every, axis=0, tiled=True)
        return jax.lax.dynamic_index_in_dim(whole.reshape((m, n_d, -1) + a.shape[1:]), d, axis=1, keepdims=False)

    local = {k: mine(v) for k, v in batch.items() if v is not None}
    grad_fn = jax.value_and_grad(scaled, has_aux=True)
    sums, counts, _, _, grads = shard_gradients(lambda sh: grad_fn(held, sh), local, m,
                                                {k: v.dtype for k, v in params.items()})
    if D:
        sums, counts = (layerwise.canonical_order(jax.lax.all_gather(a, D, axis=0, tiled=True), n_d, m)
                        for a in (sums, counts))
    return grads, sums, counts, {}, None


def record(size: int, why: str, axis: str = TP) -> dict:
    """The manifest's and the plan's `tensor` (tp) or `experts` (ep) record on such a mesh in deterministic mode."""
    return {axis: size, "split_compute": not why, "why_not": why or None}
