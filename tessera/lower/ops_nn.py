"""Reference lowerings of the neural-network ops (tessera/ir/ops_nn.py).

Parameters arrive in their storage type and are cast to the op's compute type at use (fp32 master
weights, bf16 compute). Attention is stateful: while generating, each attention op keeps a KV cache
(a ring buffer of its window for sliding-window layers) and positions are absolute. Each kind of the
struct families the ops read (rope, act) has its implementation here, registered by kind.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tessera.ir.ops_nn import cache_len
from tessera.ir.registry import struct_families, struct_fields
from tessera.ir.types import ParamRef

from tessera.lower.context import jnp_dtype
from tessera.lower.fp8_held import held_of
from tessera.lower.named import align, einsum, move_last, names, stored_dtype
from tessera.lower.reference import accum as accum_ref, activations, fp8 as fp8_ref, kv_cache, moe as moe_ref, \
    mxfp4, packed as packed_ref, rope as rope_ref
from tessera.lower.reference.fp8_blocks import FP8Blocks
from tessera.lower.reference.attention import attention as attention_ref
from tessera.lower.reference.linear import plus_bias
from tessera.lower.reference.norms import layer_norm, rms_norm
from tessera.lower.reference.rows import take_rows
from tessera.lower.shard import det_tensor, ops as shard_ops
from tessera.lower import fp8_mlp, table
from tessera.lower.table import get_kind_lowering, lowers, lowers_kind

BSE = ("batch", "seq", "embed")


def op_scope(op) -> str:
    """The op's scope in the model source (`layers/attention`), from the paths of its parameters."""
    refs = [o.path for o in op.operands if isinstance(o, ParamRef)]
    return refs[0].rsplit("/", 1)[0] if refs else op.name


def _dtype(op, i: int = 0):
    return jnp_dtype(op.results[i].type.dtype)


def _cast(params: dict, dtype, packed: tuple[str, ...] = (), fp8_blocks_held: bool = False) -> dict:
    """Floating params cast to `dtype`; packed ones dequantised to it, except MXFP4 ones named in `packed` (the
    experts' grouped products take those as they are) and, with `fp8_blocks_held`, block-scaled fp8 ones (which
    `_weight_product` then multiplies without a dequantised copy)."""
    def cast(k, v):
        if packed_ref.is_packed(v):
            keep = (k in packed and isinstance(v, mxfp4.MXFP4)) or (fp8_blocks_held and isinstance(v, FP8Blocks))
            return v if keep else packed_ref.dequantize(v, dtype)
        return v.astype(dtype) if v is not None and jnp.issubdtype(v.dtype, jnp.floating) else v

    return {k: cast(k, v) for k, v in params.items()}


@lowers("embed")
def _embed(ctx, op, attrs, ins, params):
    table = params["table"]
    if packed_ref.is_packed(table):
        table = packed_ref.dequantize(table, _dtype(op))
    if ctx.shard is not None:
        return [shard_ops.embed(ctx.shard, table, ins[0]).astype(_dtype(op))]
    return [take_rows(table, ins[0]).astype(_dtype(op))]  # its gradient: no scatter-add (reference/rows.py)


@lowers("unembed")
def _unembed(ctx, op, attrs, ins, params):
    x, dt = ins[0], _dtype(op)
    have = names(op.values[0])
    out = names(op.results[0])
    if ctx.shard is not None:  # logits stay split over vocab: [..., vocab / tp]
        x = ctx.shard.seq_gather(x, axis=have.index("seq"))
    if ctx.last_only and "seq" in have:  # only the last position is read (prefill): [batch, 1, vocab]
        x = jax.lax.slice_in_dim(x, x.shape[have.index("seq")] - 1, None, axis=have.index("seq"))
    store = stored_dtype(dt, ctx.accum_dtype)
    fp8 = ctx.fp8  # set only where a numerics.compute rule puts the unembedding in fp8 (interpret._eval_op)
    if attrs["tied"]:
        name = "embed/table" if "embed/table" in params else "table"
        table = packed_ref.dense(params[name], x.dtype)  # [vocab, embed]
        cast = _logits_cast(ctx, name, x, have, table.shape[0], store)
        return [einsum([have, ("vocab", "embed")], out, x, table, accum=ctx.accum_dtype, store=store, fp8=fp8,
                       fp8_history=_history(ctx, name), fp8_cast=cast).astype(dt)]
    w = packed_ref.dense(params["weight"], x.dtype)
    cast = _logits_cast(ctx, "weight", x, have, w.shape[1], store)
    return [einsum([have, ("embed", "vocab")], out, x, w, accum=ctx.accum_dtype, store=store, fp8=fp8,
                   fp8_history=_history(ctx, "weight"), fp8_cast=cast).astype(dt)]


def _logits_cast(ctx, name: str, x, have, vocab: int, store):
    """`_gradient_cast` for the unembedding in fp8 (a rule's): its gradient the logits' [tokens, vocab]."""
    if not ctx.fp8:
        return None
    return _gradient_cast(ctx, name, (x.size // x.shape[have.index("embed")], vocab), store, _history(ctx, name))


@lowers("pos_embed")
def _pos_embed(ctx, op, attrs, ins, params):
    have, x = names(op.values[0]), ins[0]
    if attrs["grid"] is None:
        table = params["table"]  # [seq, embed]
    else:  # cell (r, c, ...) of a row-major grid: the sum of each axis's vector
        axes = len(attrs["grid"])
        parts = [jnp.expand_dims(params[d.name], [k for k in range(axes) if k != i]) for i, d in
                 enumerate(attrs["grid"])]  # each [1.., size, 1.., embed]
        table = functools.reduce(jnp.add, parts).reshape(-1, x.shape[have.index("embed")])
    table, dims = table.astype(x.dtype), ("seq", "embed")
    if ctx.positions is not None or ctx.shard is not None:  # decoding or context parallel: absolute positions
        table = table[_positions(ctx, x.shape[have.index("batch")], x.shape[have.index("seq")])]
        dims = ("batch", "seq", "embed")
    return [(x + align(table, dims, have)).astype(_dtype(op))]


def _norm(fn):
    def lower(ctx, op, attrs, ins, params):
        have, dim = names(op.values[0]), attrs["dim"].name
        x, _ = move_last(ins[0], have, dim)
        y = fn(x, attrs, params)
        return [jnp.moveaxis(y, -1, have.index(dim)).astype(_dtype(op))]

    return lower


lowers("rmsnorm")(_norm(lambda x, a, p: rms_norm(x, scale=p["scale"], eps=a["eps"])))
lowers("layernorm")(_norm(lambda x, a, p: layer_norm(x, scale=p["scale"], bias=p["bias"], eps=a["eps"])))


@lowers("linear")
def _linear(ctx, op, attrs, ins, params):
    x, dt = ins[0], _dtype(op)
    over = tuple(d.name for d in attrs["over"])
    out_dims = tuple(d.name for d in attrs["out"])
    y = einsum([names(op.values[0]), over + out_dims], names(op.results[0]), x,
               packed_ref.dense(params["weight"], x.dtype), accum=ctx.accum_dtype, store=stored_dtype(dt, ctx.accum_dtype),
               fp8=ctx.fp8, fp8_history=_history(ctx, "weight"), fp8_held=held_of(ctx, "weight", x.dtype))
    if "bias" in params:
        y = plus_bias(y, align(params["bias"], out_dims, names(op.results[0])))
    return [y.astype(dt)]


# ---- rope kinds: (head_dim, fields) -> RopeTable (inv_freq, scaling of cos and sin, grid columns) ---------------

@lowers_kind("rope", "rotary")
def _rotary(head_dim: int, f: dict):
    return rope_ref.RopeTable(rope_ref.rope_inv_freq(head_dim=head_dim, theta=f["theta"]))


@lowers_kind("rope", "yarn")
def _yarn(head_dim: int, f: dict):
    return rope_ref.RopeTable(*rope_ref.yarn_inv_freq(
        head_dim=head_dim, theta=f["theta"], factor=f["factor"], original=f["original"], beta_fast=f["beta_fast"],
        beta_slow=f["beta_slow"], truncate=f["truncate"]))


@lowers_kind("rope", "llama3")
def _llama3(head_dim: int, f: dict):
    return rope_ref.RopeTable(rope_ref.llama3_inv_freq(
        head_dim=head_dim, theta=f["theta"], factor=f["factor"], original=f["original"],
        low_freq_factor=f["low_freq_factor"], high_freq_factor=f["high_freq_factor"]))


@lowers_kind("rope", "rotary2d")
def _rotary2d(head_dim: int, f: dict):
    return rope_ref.RopeTable(rope_ref.rotary2d_inv_freq(head_dim=head_dim, theta=f["theta"]), cols=f["cols"])


@functools.lru_cache(maxsize=64)
def _rope_tables(rope, head_dim: int) -> rope_ref.RopeTable:
    """The RopeTable of a rope attribute (`rotary{theta}`, `yarn{...}`, `llama3{...}`, `rotary2d{...}`) by its
    kind's lowering; fields the model left out take the kind's defaults."""
    return get_kind_lowering("rope", rope.kind)(head_dim, struct_fields(rope))


def _positions(ctx, batch: int, seq: int):
    """int32 [batch, seq] absolute positions: the context's, else 0..seq-1 from this block's start."""
    if ctx.positions is not None:
        return ctx.positions
    start = ctx.shard.seq_start(seq) if ctx.shard is not None else 0  # context parallel: a block of the sequence
    return jnp.broadcast_to(start + jnp.arange(seq, dtype=jnp.int32), (batch, seq))


def apply_rope(ctx, rope, x):
    """x [B, S, H, D] rotated at the context's absolute positions."""
    t = _rope_tables(rope, x.shape[-1])
    cos, sin = rope_ref.rope_cos_sin(_positions(ctx, x.shape[0], x.shape[1]), inv_freq=t.inv_freq, scaling=t.scaling,
                                     cols=t.cols)
    return rope_ref.apply_rope(x, cos=cos, sin=sin)


@lowers("rope")
def _rope(ctx, op, attrs, ins, params):
    have = names(op.values[0])
    heads = "heads" if "heads" in have else "kv_heads"
    want = ("batch", "seq", heads, "head_dim")
    y = apply_rope(ctx, attrs["rope"], align(ins[0], have, want))
    return [align(y, want, have).astype(_dtype(op))]


# ---- act kinds: (fields, gate, up) -> the activation ----------------------------------------------------------

@lowers_kind("act", "swiglu")
def _swiglu(f: dict, gate, up):
    if f["alpha"] is None:
        return activations.swiglu(gate, up)
    return activations.clamped_swiglu(gate, up, alpha=f["alpha"], limit=f["limit"])


def _act(act, gate, up):
    """act(gate, up) for an `act` attribute of mlp or moe, by its kind's lowering."""
    return get_kind_lowering("act", act.kind)(struct_fields(act), gate, up)


def _act_op(ctx, op, attrs, ins, params):
    """The primitive op of an act kind (`swiglu(gate, up)`): its attributes are the kind's fields."""
    gate, up = ins[0], align(ins[1], names(op.values[1]), names(op.values[0]))
    return [get_kind_lowering("act", op.name)(attrs, gate, up).astype(_dtype(op))]


for _kind in struct_families()["act"]:  # each act kind is also an op (tessera/ir/ops_nn.py)
    lowers(_kind)(_act_op)


@lowers("sdpa")
def _sdpa(ctx, op, attrs, ins, params):
    q = align(ins[0], names(op.values[0]), ("batch", "seq", "heads", "head_dim"))
    k = align(ins[1], names(op.values[1]), ("batch", "seq", "kv_heads", "head_dim"))
    v = align(ins[2], names(op.values[2]), ("batch", "seq", "kv_heads", "head_dim"))
    sinks = ins[3] if len(ins) == 4 else None
    pos = _positions(ctx, q.shape[0], q.shape[1])
    if ctx.shard is not None and ctx.positions is None:  # context parallel: keys of the whole sequence
        k, v = ctx.shard.context_gather(k), ctx.shard.context_gather(v)
    out = attention_ref(q, k, v, sinks=sinks, causal=attrs["causal"], window=attrs["window"],
                        scale=attrs["scale"], q_offset=pos[:, 0], accum=ctx.accum_dtype)
    return [align(out, ("batch", "seq", "heads", "head_dim"), names(op.results[0])).astype(_dtype(op))]


def _history(ctx, name: str):
    """The amax history of the op's weight `name` under delayed fp8 scaling in a train step, else None."""
    return ctx.fp8_history.get(name) if ctx.fp8_history else None


def _one_token(ctx, x) -> bool:
    """Whether a block's products are decode-sized (one token: batch-1 decode) and accumulate in fp32: then
    block-scaled fp8 weights multiply without a dequantised copy (fp8_blocks.weight_only_einsum)."""
    return x.shape[0] * x.shape[1] == 1 and ctx.fp8 is None and not accum_ref.narrow(ctx.accum_dtype)


def _gradient_cast(ctx, name: str, matrix, dtype, history):
    """The kernel the backward of a delayed fp8 product (weight `name`, its output gradient the [tokens, outputs]
    `matrix` of `dtype`) quantises that gradient with, writing the codes in both layouts and the amax in one pass
    (`cast_transpose_delayed`, tessera/lower/kernels/fp8_cast.py), or None: the product quantises it itself (the
    same numbers; the reference, which the CPU runs)."""
    if history is None or matrix is None or accum_ref.narrow(ctx.accum_dtype):
        return None
    choice, fn = table.choose(ctx, "cast_transpose_delayed", jax.ShapeDtypeStruct(matrix, dtype),
                              jax.ShapeDtypeStruct(history.shape[-1:], jnp.float32))
    if ctx.report is not None:
        ctx.report[f"{name}: gradient to e5m2"] = choice
    return None if choice.startswith(table.REFERENCE_NAME) else fn


def _shared_row(ctx, names: tuple[str, ...]):
    """Under delayed fp8 scaling, the input row of the first of the products `names` of one x (q, k and v; gate and
    up) when each has a history of one shape: their input rows record the same amaxes (x's) every step, so scaling x
    by the first's for all of them changes no number, and XLA merges their equal casts of x (the forward's and the
    backward's recomputed, transposed ones). Else None: each its own row."""
    rows = [_history(ctx, n) for n in names]
    if any(r is None for r in rows) or len({r.shape for r in rows}) != 1:
        return None
    return rows[0][0]


def _weight_product(ctx, spec: str, x, w, store, name: str, x_row=None):
    """x ⊗ w for the op's weight `name`: in fp8 under an fp8 policy (reference/fp8.py), a block-scaled fp8 weight
    still held as such (one token: `_one_token`) read once in a fused multiply-reduce, else accumulating in
    ctx.accum_dtype. `x_row`: `_shared_row`'s."""
    if isinstance(w, FP8Blocks):
        return table.dispatch(ctx, "weight_only_einsum", f"{name} (held fp8 blocks, one token)", spec, x, w,
                              compute_dtype=x.dtype, out_dtype=store)
    if ctx.fp8 is not None:
        history = _history(ctx, name)
        cast = _gradient_cast(ctx, name, fp8_ref.gradient_matrix(spec, x.shape, w.shape), store, history)
        return fp8_ref.einsum(spec, x, w, accum=ctx.accum_dtype, preferred_element_type=store, scaling=ctx.fp8,
                              history=history, held=held_of(ctx, name, w.dtype), cast=cast, x_row=x_row)
    return accum_ref.einsum(spec, x, w, accum=ctx.accum_dtype, preferred_element_type=store)


def _project(ctx, x, w, b, name: str, x_row=None):
    # x [B, S, E] @ w [E, H, D] (+ b [H, D]) -> [B, S, H, D]
    w = w if isinstance(w, FP8Blocks) else w.astype(x.dtype)
    y = _weight_product(ctx, "bse,ehd->bshd", x, w, stored_dtype(x.dtype, ctx.accum_dtype), name, x_row)
    if b is not None:
        y = plus_bias(y, b)
    return y.astype(x.dtype)


def _tensor_chunks(ctx):
    """(k, axes) where deterministic tp chunks this block's contractions (LowerCtx.tensor; a train step's full
    sequence, no fast-mode shard env, no fp8: a chunk's scale would be its own), else None."""
    if ctx.tensor is None or ctx.shard is not None or ctx.positions is not None:
        return None
    if ctx.fp8 is not None:
        raise NotImplementedError("parallel.canonical_tp with fp8 compute: the scales would differ per chunk")
    return ctx.tensor


def _chunked_columns(ctx, xs, w, b, dim: int, spec: str, name: str):
    """A column-parallel product of `fan_out`'s [k, ...] input with w cut into k chunks along its output dim `dim`
    (`b`, the bias, along its dim dim - 1): [k, ..., out/k, ...] per chunk, in the op's compute type."""
    k = xs.shape[0]
    if w.shape[dim] % k:
        raise ValueError(f"{name}: {w.shape[dim]} columns do not split into parallel.canonical_tp's {k} chunks")
    y = accum_ref.einsum(spec, xs, det_tensor.chunked(w.astype(xs.dtype), dim, k), accum=ctx.accum_dtype,
                         preferred_element_type=stored_dtype(xs.dtype, ctx.accum_dtype))
    if b is not None:
        bc = det_tensor.chunked(b, dim - 1, k)
        y = plus_bias(y, bc.reshape(bc.shape[:1] + (1,) * (y.ndim - bc.ndim) + bc.shape[1:]))
    return y.astype(xs.dtype)


def attention_cache_init(ctx, op, attrs, batch: int, max_len: int):
    """An empty KV cache: k, v [B, C, kv_heads, head_dim], pos [B, C] (-1 = empty); C = ir.ops_nn.cache_len."""
    c = cache_len(max_len, attrs["window"])
    dt = _dtype(op)
    kv_heads = attrs["kv_heads"] // (ctx.shard.ways("kv_heads") if ctx.shard is not None else 1)
    shape = (batch, c, kv_heads, attrs["head_dim"])
    return {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt), "pos": jnp.full((batch, c), -1, jnp.int32)}


@lowers("attention", stateful=True, init_state=attention_cache_init)
def _attention(ctx, op, attrs, ins, params, cache):
    have = names(op.values[0])
    x = align(ins[0], have, BSE)
    if ctx.shard is not None:  # sequence parallel: the block sees the whole sequence
        x = ctx.shard.seq_gather(x)
    p = _cast(params, x.dtype, fp8_blocks_held=_one_token(ctx, x))
    chunks = _tensor_chunks(ctx)
    if chunks is not None:  # deterministic tp: q, k, v by chunks of heads, the input's gradient a tree over them
        xs = det_tensor.fan_out(x, chunks[0], chunks[1])
        q, k, v = (det_tensor.unchunked(_chunked_columns(ctx, xs, p[n], p.get(f"{n}_bias"), 1, "kbse,kehd->kbshd",
                                                         n), 2) for n in ("q", "k", "v"))
    else:
        row = _shared_row(ctx, ("q", "k", "v"))
        q, k, v = (_project(ctx, x, p[n], p.get(f"{n}_bias"), n, row) for n in ("q", "k", "v"))
    if attrs["rope"] is not None:
        q, k = apply_rope(ctx, attrs["rope"], q), apply_rope(ctx, attrs["rope"], k)
    pos = _positions(ctx, x.shape[0], x.shape[1])
    core = dict(sinks=params.get("sinks"), causal=attrs["causal"], window=attrs["window"], scale=attrs["scale"])
    label = f"{op_scope(op)} (window {attrs['window']})"
    if ctx.positions is None:  # a whole sequence from position 0 (or a context-parallel block of it)
        offset = 0
        if ctx.shard is not None:  # context parallel: queries [b, s/sp] at their offset, K/V gathered [b, s]
            offset = ctx.shard.seq_start(x.shape[1])
            k, v = ctx.shard.context_gather(k), ctx.shard.context_gather(v)
        if chunks is not None:  # each chunk of heads attended on its own (det_tensor.per_chunk)
            out = det_tensor.per_chunk(
                lambda q_, k_, v_, s_: table.dispatch(ctx, "attention", label, q_, k_, v_, q_offset=offset,
                                                      **{**core, "sinks": s_}),
                chunks[0], q, k, v, core["sinks"])
            new_cache = None
        else:
            out, new_cache = table.dispatch(ctx, "attention", label, q, k, v, q_offset=offset, **core), None
    elif ctx.mode == "prefill":  # the generation program's prompt, from position 0: the kernels' whole sequence
        out = table.dispatch(ctx, "attention", label, q, k, v, q_offset=0, **core)
        new_cache = None if cache is None else kv_cache.cache_write(cache, k, v, pos, ctx.position_start)
    elif cache is None:
        out = attention_ref(q, k, v, q_offset=pos[:, 0], accum=ctx.accum_dtype, **core)
        new_cache = None
    else:  # decode: the new tokens join the cache, then attend over it
        new_cache = kv_cache.cache_write(cache, k, v, pos, ctx.position_start)
        out = table.dispatch(ctx, "decode_attention", label + " (decode)", q, new_cache, pos[:, 0], **core)
    store = stored_dtype(_dtype(op), ctx.accum_dtype, partial=ctx.shard is not None or chunks is not None)
    if chunks is not None:  # row-parallel o: each chunk of heads' partial product, summed in the canonical tree
        kc = chunks[0]
        parts = accum_ref.einsum("kbshd,khde->kbse", det_tensor.chunked(out, 2, kc),
                                 det_tensor.chunked(p["o"].astype(out.dtype), 0, kc), accum=ctx.accum_dtype,
                                 preferred_element_type=store)
        y = det_tensor.reduce_chunks(parts, chunks[1])
    else:
        y = _weight_product(ctx, "bshd,hde->bse", out, p["o"], store, "o")
    if ctx.shard is not None:  # row-parallel o: partial sums over this device's heads
        y = ctx.shard.reduce_out(y, "heads")
    if "o_bias" in p:
        y = plus_bias(y, p["o_bias"])
    return [align(y.astype(_dtype(op)), BSE, have)], new_cache


@lowers("mlp")
def _mlp(ctx, op, attrs, ins, params):
    have = names(op.values[0])
    x = align(ins[0], have, BSE)
    if ctx.shard is not None:
        x = ctx.shard.seq_gather(x)
    p = _cast(params, x.dtype, fp8_blocks_held=_one_token(ctx, x))
    chunks = _tensor_chunks(ctx)
    if chunks is not None:  # deterministic tp: gate and up by chunks of columns, down's partials in the tree
        xs = det_tensor.fan_out(x, chunks[0], chunks[1])
        g, u = (_chunked_columns(ctx, xs, p[n], p.get(f"{n}_bias"), 1, "kbse,kef->kbsf", n) for n in ("gate", "up"))
        h = _act(attrs["act"], g, u)
        parts = accum_ref.einsum("kbsf,kfe->kbse", h, det_tensor.chunked(p["down"].astype(h.dtype), 0, chunks[0]),
                                 accum=ctx.accum_dtype, preferred_element_type=ctx.accum_dtype)
        y = det_tensor.reduce_chunks(parts, chunks[1])
        if "down_bias" in p:
            y = plus_bias(y, p["down_bias"])
        return [align(y.astype(_dtype(op)), BSE, have)]
    cols = stored_dtype(x.dtype, ctx.accum_dtype)
    rows = stored_dtype(_dtype(op), ctx.accum_dtype, partial=ctx.shard is not None)
    if fp8_mlp.applies(ctx, attrs, p, x):  # delayed fp8: SwiGLU's backward and its codes' casts in one pass
        h_shape = x.shape[:2] + p["gate"].shape[-1:]
        cast = _gradient_cast(ctx, "down", fp8_ref.gradient_matrix("bsf,fe->bse", h_shape, p["down"].shape), rows,
                              _history(ctx, "down"))
        y = fp8_mlp.mlp(ctx, op_scope(op), x, p["gate"], p["up"], p["down"], cols, rows, cast)
        return [align(y.astype(_dtype(op)), BSE, have)]
    row = _shared_row(ctx, ("gate", "up"))
    g = _weight_product(ctx, "bse,ef->bsf", x, p["gate"], cols, "gate", row)
    u = _weight_product(ctx, "bse,ef->bsf", x, p["up"], cols, "up", row)
    if "gate_bias" in p:
        g, u = plus_bias(g, p["gate_bias"]), plus_bias(u, p["up_bias"])
    h = _act(attrs["act"], g.astype(x.dtype), u.astype(x.dtype))
    y = _weight_product(ctx, "bsf,fe->bse", h, p["down"], rows, "down")
    if ctx.shard is not None:  # row-parallel down: partial sums over this device's mlp columns
        y = ctx.shard.reduce_out(y, "mlp")
    if "down_bias" in p:
        y = plus_bias(y, p["down_bias"])
    return [align(y.astype(_dtype(op)), BSE, have)]


EXPERT_MATRICES = ("experts/gate", "experts/up", "experts/down")  # may stay packed: ragged_dot takes MXFP4


@lowers("moe")
def _moe(ctx, op, attrs, ins, params):
    have = names(op.values[0])
    x = align(ins[0], have, BSE)
    if ctx.shard is not None:
        y = shard_ops.moe(ctx.shard, x, _cast(params, x.dtype, EXPERT_MATRICES), top_k=attrs["top_k"],
                          act=functools.partial(_act, attrs["act"]),  # packed experts go to ragged_dot as is
                          ragged_dot=table.bound(ctx, "ragged_dot", f"{op_scope(op)} experts"), aux=ctx.aux,
                          accum=ctx.accum_dtype)
        return [align(y.astype(_dtype(op)), BSE, have)]
    b, s, e = x.shape
    p = _cast(params, x.dtype, EXPERT_MATRICES)
    zeros = functools.partial(jnp.zeros, dtype=x.dtype)
    n_exp, d_ff = p["experts/gate"].shape[0], p["experts/gate"].shape[-1]
    args = dict(router=p["router"], router_bias=p.get("router_bias"),
                gate=p["experts/gate"], up=p["experts/up"], down=p["experts/down"],
                gate_bias=p.get("experts/gate_bias", zeros((n_exp, d_ff))),
                up_bias=p.get("experts/up_bias", zeros((n_exp, d_ff))),
                down_bias=p.get("experts/down_bias", zeros((n_exp, e))),
                top_k=attrs["top_k"], act=functools.partial(_act, attrs["act"]), accum=ctx.accum_dtype)
    if ctx.fp8_history:  # delayed fp8 scaling in a train step: each grouped product with its amax history
        args["fp8_history"] = {m: _history(ctx, f"experts/{m}") for m in ("gate", "up", "down")}
    label = f"{op_scope(op)} experts"
    if ctx.mode == "decode":  # nothing differentiates a decode step's routing: a kernel may do it (moe_route)
        args["route_blocks"] = table.bound(ctx, "route_blocks", f"{op_scope(op)} routing")
    chunks = _tensor_chunks(ctx)
    if chunks is not None:  # deterministic tp: the experts' hidden dim in canonical chunks
        args["chunks"] = chunks
    if ctx.experts is not None and ctx.shard is None and ctx.positions is None:  # deterministic ep: the experts
        args["expert_chunks"] = ctx.experts                                       # in canonical chunks
    few = ctx.mode == "decode" and b * s * attrs["top_k"] <= moe_ref.PAIRS_MAX
    if few and isinstance(p["experts/gate"], mxfp4.MXFP4):  # no sort, no scatter (measured for packed experts)
        y = moe_ref.moe_pairs(x.reshape(b * s, e), **args, experts_ffn=table.bound(ctx, "pairs_ffn", label))
    else:
        y = moe_ref.moe(x.reshape(b * s, e), **args, ragged_dot=table.bound(ctx, "ragged_dot", label))
    return [align(y.reshape(b, s, e).astype(_dtype(op)), BSE, have)]
