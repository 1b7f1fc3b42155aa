"""Deterministic mode's per-layer gathers: parameters held in blocks are made whole where an op reads them (inside
the layer scan: one layer at a time), and each gather's VJP sums the devices' gradients of that block in the
canonical order, so no device holds the whole model or a whole gradient while the canonical shards run.

The order is docs/parallel.md's design. With C canonical shards and n devices (both powers of two, m = C / n),
device d processes shards d, n + d, 2n + d, ... (`interleaved`): in iteration j the n devices hold shards
j·n … j·n + n − 1, one aligned subtree of the balanced tree `tree_sum` builds over the C leaves. A gather's VJP
(`gather_at_use`) sends each device its block of this device's cotangent (an all-to-all) and sums the n pieces
with `tree_sum` in device order: that subtree's sum, for this device's block. The m iterations' block sums are then
tree-summed: the tree's upper levels. These are the adds one device makes over its C shards (where every gather is
the identity and every VJP a single piece), so the gradients are the same bits on every mesh.

A parameter read by more than one op, inside a weight-shared repeat or a region other than a stacked `repeat`, or
stacked with its layers dim split over the mesh (pp) is gathered once per canonical shard before the model runs
(`use_plan`): its gradient's uses are then summed within the shard before the tree, as on one device.

The shard loop reads the layers unrolled over weights split into their layers before the loop (`split`, the
lowering's `LowerCtx.unroll`), on every mesh and one device alike: inside a layer scan XLA:GPU copies each layer's
slice of every stacked weight a GEMM reads and zero-fills the stacked gradients, once per canonical shard, where
split weights are read in place and each layer's gradient is its own buffer (`restack` stacks them again after the
shards' sum). Measured (bench/experiments/det_unrolled.py, one H100): the Llama-1B step at C = 8 382.0 ms unrolled
against the scan's 410.1, GPT-OSS-20B's two layers at C = 2 179.3 against 170.3, so the loop unrolls from
`UNROLL_FROM` canonical shards (`unrolls`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tessera.ir.types import ParamRef
from tessera.lower.shard.collectives import block_index, gather_full, local_block
from tessera.lower.shard.shard_loop import opaque_map


UNROLL_FROM = 4  # canonical shards from which the shard loop runs the layers unrolled (`unrolls`)


def unrolls(c: int, fp8: str | None) -> bool:
    """Whether the per-layer step's shard loop over C canonical shards runs the layers unrolled over weights split
    into their layers before it (`split`) rather than as the layer scan, on every mesh alike (C, not a device's
    share of it, decides); `fp8` the graph's fp8 scaling. The scan copies each layer's slice of the stacked weights in
    every shard (C copies of the weights a step); unrolled pays one split of the weights and one restacking of the
    gradients. Measured on one H100 (bench/experiments/det_unrolled.py): Llama-1B at C = 8 410.1 -> 382.0 ms,
    GPT-OSS-20B's layers at C = 2 170.3 -> 179.3 ms; so from `UNROLL_FROM` shards. Never under delayed fp8 scaling,
    whose amax histories ride stacked beside their weights through the layer scan."""
    return c >= UNROLL_FROM and not str(fp8 or "").startswith("delayed")


def _entry_axes(e) -> tuple[str, ...]:
    return (e,) if isinstance(e, str) else tuple(e)


def blocks_of_all(x, spec: P, axes: tuple[str, ...], sizes: dict[str, int], chunk_over: tuple[str, ...] = ()):
    """[n, *block]: row t is device t's block of the whole tensor x (devices in order, row-major over `axes`; a
    block replicated over some axes appears once for each device that holds it). `chunk_over`: axes of `axes` the
    block is replicated over (r devices hold each block): row t is then the q-th of r equal chunks of device t's
    block, flattened (zero-padded), q the device's index over those axes, so the rows hold the tensor once."""
    n = math.prod(sizes[a] for a in axes)
    r = math.prod(sizes[a] for a in chunk_over)
    entries = [(i, _entry_axes(e)) for i, e in enumerate(spec) if e is not None]
    rows = []
    for t in range(n):
        coord = dict(zip(axes, np.unravel_index(t, [sizes[a] for a in axes]))) if axes else {}
        blk = x
        for i, names in entries:
            idx = 0
            for a in names:
                idx = idx * sizes[a] + int(coord[a])
            size = x.shape[i] // math.prod(sizes[a] for a in names)
            blk = jax.lax.slice_in_dim(blk, idx * size, (idx + 1) * size, axis=i)
        if chunk_over:
            q = 0
            for a in chunk_over:
                q = q * sizes[a] + int(coord[a])
            flat = blk.reshape(-1)
            csize = -(-flat.shape[0] // r)
            blk = jnp.pad(flat, (0, csize * r - flat.shape[0]))[q * csize:(q + 1) * csize]
        rows.append(blk)
    return jnp.stack(rows)


def gather_at_use(held: Held, spec: P, full_ndim: int, axes: tuple[str, ...], sizes: dict[str, int],
                  own: tuple[str, ...] = ()):
    """The whole tensor of a `Held` block (its narrow copy's where it has one; `spec` the PartitionSpec of the whole
    parameter, of `full_ndim` dims, held a layer's slice inside a repeat), whose VJP gives `wide` this device's
    block of the devices' cotangents, widened to wide's type and summed in device order over `axes` (`narrow`, a
    constant of the step, gets none). On a mesh only: one device reads its parameters as they are. `own`: mesh axes
    of the spec, not in `axes`, along which the devices computed alike (deterministic tp's or ep's group: a
    vocab-split table every device of the group uses whole): the cotangent is the same on each of them, so the VJP
    keeps this device's block along each and sums over `axes` only."""
    spec = trailing(spec, full_ndim, held.ndim)
    wide_dtype = held.wide.dtype

    @jax.custom_vjp
    def use(wide, narrow):
        return gather_full(wide if narrow is None else narrow, spec)

    def fwd(wide, narrow):
        return use(wide, narrow), None

    def bwd(_, g):
        g, rest = own_block(g, spec, own)
        return block_sum(g, rest, axes, sizes, wide_dtype), None

    use.defvjp(fwd, bwd)
    return use(held.wide, held.narrow)


def own_block(g, spec, own: tuple[str, ...]):
    """(this device's block of g along the `own` axes of `spec`, the spec without them): the cotangent of a tensor
    that the devices along those axes computed alike, cut to the block this device holds."""
    g = local_block(g, P(*(e if e in own else None for e in tuple(spec))))
    for a in own:
        spec = without(spec, a)
    return g, spec


def entries_with(spec, axis: str) -> list[int]:
    """The dims of `spec` split over `axis` (alone or with other axes)."""
    return [i for i, e in enumerate(tuple(spec)) if e == axis or (isinstance(e, tuple) and axis in e)]


def without(spec, axis: str):
    """`spec` with `axis` taken out of every entry."""
    out = []
    for e in tuple(spec):
        if isinstance(e, tuple):
            rest = tuple(a for a in e if a != axis)
            e = rest if len(rest) > 1 else (rest[0] if rest else None)
        elif e == axis:
            e = None
        out.append(e)
    return P(*out)


_FP8 = frozenset(jnp.dtype(t) for t in (jnp.float8_e4m3fn, jnp.float8_e5m2))


def block_sum(g, spec: P, axes: tuple[str, ...], sizes: dict[str, int], wide_dtype):
    """This device's block of the devices' whole cotangents g (each device's own g), widened to `wide_dtype` and
    summed in device order over `axes` (an all-to-all, then `tree_sum`): a gather's VJP (`gather_at_use`, and the
    pipelined pp step's gathers outside its fenced pieces). Without axes, g widened. A block the spec does not split
    over some of `axes` (a parameter replicated over dp) is held alike by r devices: each sums one r-th of it and
    the r chunks are gathered (the same adds), so the all-to-all carries the tensor once where it carried r copies
    (llama_tiny at d_model 256, 8 layers: the compiled step on tp=2 x dp=4 with canonical_tp 2 went from 109.6 to
    104.3 MB a device, on pp=2 x dp=4 from 131.0 to 123.1)."""
    from tessera.lower.shard.deterministic import tree_sum

    g = g.astype(wide_dtype)
    if not axes:
        return g
    split = {a for e in spec if e is not None for a in _entry_axes(e)}
    rep = tuple(a for a in axes if a not in split)  # the block is the same on these devices (dp): each sums a chunk
    pieces = jax.lax.all_to_all(blocks_of_all(g, spec, axes, sizes, chunk_over=rep), axes, 0, 0)
    mine = tree_sum(pieces)  # row j of pieces: device j's piece of this device's block (or of its chunk of it)
    if not rep:
        return mine
    shape = [d // math.prod(sizes[a] for a in _entry_axes(e)) if e is not None else d
             for d, e in zip(g.shape, tuple(spec) + (None,) * (g.ndim - len(tuple(spec))))]
    whole = jax.lax.all_gather(mine, rep, axis=0, tiled=True)  # the r chunks, in the order `blocks_of_all` cut them
    return whole[:math.prod(shape)].reshape(shape)


def saveable_but_gathers(prim, *_, **params) -> bool:
    """The remat policy (`jax.checkpoint`) of a layer whose parameters are gathered where they are read
    (`gather_at_use`), where the spec asks for no remat: every value saved but the gathered parameters (a custom_vjp
    whose forward sums over devices), which the backward gathers again, and fp8 values, recomputed. Deterministic
    mode hands it to the lowering as LowerCtx.layer_remat beside its gathers.

    fp8: jax rounds each value a policy saves with `reduce_precision` at its type's exponent and mantissa widths,
    whose IEEE semantics reserve the top exponent for inf, so an e4m3fn value from 256 to 448 (e4m3fn has no inf
    and uses that exponent for numbers) became inf, then NaN as e4m3fn: a quantised operand's largest values, and
    with them the loss, were NaN in every fp8 deterministic step on a mesh (session 33)."""
    if prim.name == "convert_element_type" and jnp.dtype(params.get("new_dtype", jnp.float32)) in _FP8:
        return False
    jaxpr = params.get("call_jaxpr", params.get("fun_jaxpr"))  # the primal's jaxpr, named either way by jax version
    if not prim.name.startswith("custom_vjp_call") or jaxpr is None:
        return True
    return not any(e.primitive.name.startswith("psum") for e in getattr(jaxpr, "jaxpr", jaxpr).eqns)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Held:
    """A parameter block as the shard loop gets it: `wide` as held (its gradient's type) and `narrow`, the copy cast
    once before the loop where the model's only use of it is a narrowing cast (tessera/lower/precast.py), else
    None. Shaped like `wide`, so a repeat slices it per layer like any stacked parameter."""

    wide: jax.Array
    narrow: jax.Array | None = None

    @property
    def shape(self):
        return self.wide.shape

    @property
    def ndim(self):
        return self.wide.ndim


def held(wide, narrow=None):
    """`Held(wide, narrow)`, or a list of them for a parameter split into its layers (lists of the layers' arrays)."""
    if isinstance(wide, list):
        return [Held(w, n) for w, n in zip(wide, narrow if narrow is not None else [None] * len(wide))]
    return Held(wide, narrow)


def each(fn, v):
    """fn of v, or of each layer's element where v is split into its layers (a list)."""
    return [fn(x) for x in v] if isinstance(v, list) else fn(v)


def split(params: dict, layers: dict[str, int]) -> dict:
    """params with each parameter of `layers` ({path: n}) held stacked [n, ...] (a pytree's leaves alike) as the
    list of its n layers; one held with its layers dim split over the mesh stays a block (gathered whole, it is
    split where the shard reads it). Each layer is a `lax.split` piece: differentiated inside a shard, the pieces'
    cotangents concatenate once."""
    def pieces(v, n):
        leaves, tree = jax.tree.flatten(v)
        if isinstance(v, list) or leaves[0].shape[:1] != (n,):
            return v
        cut = [[jnp.squeeze(x, 0) for x in jax.lax.split(a, [1] * n)] for a in leaves]
        return [jax.tree.unflatten(tree, [c[i] for c in cut]) for i in range(n)]

    return {k: (pieces(v, layers[k]) if k in layers else v) for k, v in params.items()}


def restack(g):
    """A gradient split into its layers (a list) stacked again [n, ...]; any other as it is."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *g) if isinstance(g, list) else g


def trailing(spec: P, full_ndim: int, ndim: int) -> P:
    """The spec of the last `ndim` of a tensor's `full_ndim` dims (a layer's slice of a stacked parameter)."""
    entries = tuple(spec) + (None,) * (full_ndim - len(tuple(spec)))
    return P(*entries[full_ndim - ndim:])


def use_plan(graph, specs: dict, stacked: dict[str, int]) -> set[str]:
    """Paths gathered where their one op reads them: read by exactly one op, reached only through stacked `repeat`s,
    and, when stacked, with the layers dim whole on every device. The others are gathered once per shard."""
    uses: dict[str, int] = {}
    nested_ok: dict[str, bool] = {}

    def walk(region, ok: bool):
        for op in region.ops:
            for o in op.operands:
                if isinstance(o, ParamRef):
                    uses[o.path] = uses.get(o.path, 0) + 1
                    nested_ok[o.path] = nested_ok.get(o.path, True) and ok
            inner_ok = ok and op.name == "repeat" and op.attrs.get("axis") is not None
            for r in (op.region, op.second):
                if r is not None:
                    walk(r, inner_ok)

    walk(graph.body, True)
    out = set()
    for path, spec in specs.items():
        if uses.get(path) != 1 or not nested_ok.get(path, False):
            continue
        if path in stacked and tuple(spec)[:1] not in ((), (None,)):
            continue
        out.add(path)
    return out


def interleaved(batch: dict, axes: tuple[str, ...], n: int, m: int) -> dict:
    """This device's canonical shards d, n + d, …, (m − 1)·n + d of a batch held in contiguous blocks over `axes`:
    [m, rows, ...] per leaf (the batch's ints are gathered whole; they are small beside the model)."""
    d = block_index(axes) if axes else 0

    def mine(a):
        whole = jax.lax.all_gather(a, axes, axis=0, tiled=True) if axes else a
        shards = whole.reshape((m, n, -1) + a.shape[1:])
        return jax.lax.dynamic_index_in_dim(shards, d, axis=1, keepdims=False)

    return jax.tree.map(mine, batch)


def canonical_order(x, n: int, m: int):
    """Per-shard results gathered device by device ([n·m, ...], device d's iteration j at d·m + j) in canonical
    order (shard j·n + d)."""
    return x.reshape((n, m) + x.shape[1:]).swapaxes(0, 1).reshape((n * m,) + x.shape[1:])


def _chunk_dim(shape: tuple[int, ...], k: int) -> int | None:
    """The first dim of `shape` that k divides (the dim a gradient's canonical chunks cut), else None."""
    return next((i for i, s in enumerate(shape) if s % k == 0), None)


def square_sum(x):
    """The fp32 sum of squares of x: a canonical chunk's share of the global norm."""
    x = x.astype(jnp.float32)
    return jnp.sum(x * x)


def canonical_square_sums(block, spec: P, shape: tuple[int, ...], k: int, sizes: dict[str, int], prep):
    """[k] fp32: the sums of squares of a gradient's k canonical chunks (its whole `shape` cut along the first dim k
    divides), from this device's block, on every device: the block is moved so this device holds whole chunks (an
    all-to-all per split dim: exact), each chunk is reduced by the same compiled loop body whatever the mesh
    (`opaque_map`), and the k sums are gathered in chunk order. `prep`: an elementwise function of the gradient
    applied inside each chunk's reduction (the chunk loop's input is then the block itself). None when no dim of
    `shape` divides by k."""
    j = _chunk_dim(shape, k)
    if j is None:
        return None
    entries = [(i, _entry_axes(e)) for i, e in enumerate(spec) if e is not None]
    entries.sort(key=lambda e: e[0] != j)  # j's own split first: the chunk index is row-major over the moves
    x, order = block, []
    for i, names in entries:
        if i != j:
            x = jax.lax.all_to_all(x, names, j, i, tiled=True)
        order += list(names)
    mine = k // math.prod(sizes[a] for a in order) if order else k
    chunks = jnp.moveaxis(x, j, 0).reshape((mine, shape[j] // k) + tuple(s for i, s in enumerate(x.shape) if i != j))
    sums = opaque_map(lambda c: square_sum(prep(c)), chunks, mine)
    return jax.lax.all_gather(sums, tuple(order), axis=0, tiled=True) if order else sums


def planned_bytes(held: list[dict], m: int, devices: int = 1) -> dict[str, float]:
    """Per-device bytes the per-layer step holds besides each device's blocks of the parameters and optimizer state,
    for `tessera plan`. `held`: per parameter {numel, block (elements a device holds), wide and narrow (bytes an
    element, narrow 0 where none), at_use, layers (its stack's depth, 1 if not stacked)}; m: canonical shards a
    device runs. Parameters: the narrow copies of the blocks, those gathered once per shard whole, and 2.5 times
    the largest layer gathered at its use (the gathered layer, its cotangent, and part of the time the reduction's
    pieces: the backward gathers a layer again rather than keeping it, under every remat policy). It was 3 while a
    fenced layer's forward returned a copy of its gathered weights as residuals; since it hands them on in place
    this count came to 0.98-1.07 of the compiled steps' bytes for llama_tiny at d_model 256 on the CPU (fsdp=8
    with and without remat, pp=2 x dp=4, tp=2 x fsdp=4), 0.86-1.04 with 2. Gradients: each iteration's summed
    blocks and their tree sum; a parameter every one of `devices` (> 1) holds whole is summed across them in
    `ordered_sum` after the shard loop, which holds four of its gradients (the device's sum, the all-to-all's
    pieces in and out, the gathered sum) where fewer than three shards ran: on dp=4 and dp=8 (m = 2 and 1) llama_tiny
    compiled to the same 114.4 MB of temporaries, four gradients, where m + 1 counted two or three."""
    params = grads = replicated = 0.0
    for p in held:
        params += p["block"] * p["narrow"]
        if not p["at_use"]:
            params += p["numel"] * (p["narrow"] or p["wide"])
        if devices > 1 and p["block"] == p["numel"]:
            replicated += p["block"] * p["wide"]
        else:
            grads += (m + 1) * p["block"] * p["wide"]
    grads += max(m + 1, 4) * replicated
    layer = sum(p["numel"] * 4.0 / p["layers"] for p in held if p["at_use"] and p["layers"] > 1)
    single = max((p["numel"] * 4.0 for p in held if p["at_use"] and p["layers"] == 1), default=0.0)
    return {"params": params + 2.5 * max(layer, single), "gradients": grads}
