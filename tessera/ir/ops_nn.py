"""Neural-network ops: embeddings (tokens, positions), norms, rope, swiglu, attention, mlp, moe, repeat.

Ops that own parameters declare them here (names and layouts are the contract in docs/contracts.md).
Each op's facts sit in its `OpDef`: composite ops (attention, mlp, moe) and sdpa carry their
decomposition into primitives, their saved tensors and the splits their sharded lowering handles. The
struct families are registered beside the op that reads them: rope kinds beside `rope`, act kinds beside
`swiglu` (each act kind is also the primitive op of the same name, its fields the op's attributes, which
`decompose` writes and `fuse` reads back).
"""

from __future__ import annotations

import math

from tessera.ir.ops_core import need_dim, need_float, same_size, tokens
from tessera.ir.registry import AttrDef, OpDef, OpError, ParamDecl, StructKind, layer_values, register, register_struct
from tessera.ir.types import Dim, DimName, Init, Op, PerLayer, Struct, TensorType, is_float, sized_type

NORMAL, ONES, ZEROS = Init("normal", 0.02), Init("ones"), Init("zeros")
D = DimName


def _reads_none(attrs, name) -> float:
    """Active fraction of a lookup table (one row per token) or a per-channel scale: the published
    parameter counts leave both out."""
    return 0.0


def _dims(*names: str) -> tuple[DimName, ...]:
    return tuple(DimName(n) for n in names)


def _proj(b, x, w, bias, over: tuple[str, ...]):
    """x contracted with w over `over`, plus bias when given (decompositions' projections)."""
    y = b("dot", x, w, over=_dims(*over))
    return b("add", y, bias) if bias is not None else y


def _sized(t: TensorType, name: str) -> Dim:
    d = need_dim(t, name)
    if d.size is None:
        raise OpError(f"the size of dimension `{name}` of {t} is unknown here")
    return d


# ---- embeddings ----------------------------------------------------------------------------------

def _embed_rule(ins, attrs):
    if is_float(ins[0].dtype):
        raise OpError(f"token ids must be integers, got {ins[0]}")
    return [TensorType(attrs["dtype"], ins[0].dims + (Dim("embed", attrs["dim"]),))]


register(OpDef("embed", (1, 1), (AttrDef("vocab", "int"), AttrDef("dim", "int"), AttrDef("dtype", "str", "f32")),
               _embed_rule,
               params=lambda a, t: [ParamDecl("table", (Dim("vocab", a["vocab"]), Dim("embed", a["dim"])), NORMAL)],
               active_fraction=_reads_none, native_split=(("*", ("vocab",)),),
               doc="table[tokens]; results have element type `dtype` (set by the numerics pass)"))


def _unembed_rule(ins, attrs):
    x = ins[0]
    need_float(x)
    _sized(x, "embed")
    return [x.with_dims(tuple(d for d in x.dims if d.name != "embed") + (Dim("vocab", attrs["vocab"]),))]


def _unembed_params(a, types):
    d = _sized(types[0], "embed")
    if a["tied"]:  # reads the embedding table, [vocab, embed]
        return [ParamDecl("embed/table", (Dim("vocab", a["vocab"]), d), NORMAL, absolute=True)]
    return [ParamDecl("weight", (d, Dim("vocab", a["vocab"])), NORMAL)]


register(OpDef("unembed", (1, 1), (AttrDef("vocab", "int"), AttrDef("tied", "bool", False)), _unembed_rule,
               params=_unembed_params,
               flops=lambda i, o, a: 2.0 * tokens(i[0], "embed") * i[0].dim("embed").size * a["vocab"],
               contraction=True, native_split=(("*", ("vocab",)),),
               doc="logits = x @ weight [embed, vocab], or x @ embed/table^T when tied"))


def _pos_embed_rule(ins, attrs):
    x, grid = ins[0], attrs["grid"]
    need_float(x)
    seq, _ = _sized(x, "seq"), _sized(x, "embed")
    if grid is not None:
        taken = [d.name for d in grid if d.name in ("seq", "embed") or x.dim(d.name) is not None]
        if taken or len({d.name for d in grid}) != len(grid):
            raise OpError(f"grid dims {[str(d) for d in grid]} must have distinct names that are not dims of {x}")
        cells = math.prod(d.size for d in grid)
        if cells != seq.size:
            raise OpError(f"grid {[str(d) for d in grid]} has {cells} cells, but `seq` has {seq.size} positions")
    return [x]


def _pos_embed_params(a, types):
    x = types[0]
    if a["grid"] is None:  # one learned vector per position
        return [ParamDecl("table", (x.dim("seq"), x.dim("embed")), NORMAL)]
    return [ParamDecl(d.name, (d, x.dim("embed")), NORMAL) for d in a["grid"]]  # one table per grid axis


register(OpDef("pos_embed", (1, 1), (AttrDef("grid", "shape?", None),), _pos_embed_rule, params=_pos_embed_params,
               flops=lambda i, o, a: float(math.prod(d.size for d in o[0].dims)),
               doc="x + a learned vector per position: table [seq, embed]; with `grid = [row = 9, col = 9]` the "
                   "positions are the grid's cells in row-major order and the vector of cell (r, c) is "
                   "row[r] + col[c] (one table [size, embed] per grid dim, any number of dims)"))


# ---- norms, linear -------------------------------------------------------------------------------

def _norm_rule(ins, attrs):
    need_float(ins[0])
    _sized(ins[0], attrs["dim"].name)
    return [ins[0]]


def _norm_flops(ins, outs, attrs):
    return 4.0 * math.prod(d.size for d in ins[0].dims)


_NORM_ATTRS = (AttrDef("eps", "float", 1e-5), AttrDef("dim", "dim", DimName("embed")))
register(OpDef("rmsnorm", (1, 1), _NORM_ATTRS, _norm_rule,
               params=lambda a, t: [ParamDecl("scale", (t[0].dim(a["dim"].name),), ONES)], flops=_norm_flops,
               active_fraction=_reads_none,
               doc="x * rsqrt(mean(x^2 over dim) + eps) * scale, computed in fp32, cast back to x's type"))
register(OpDef("layernorm", (1, 1), _NORM_ATTRS, _norm_rule,
               params=lambda a, t: [ParamDecl("scale", (t[0].dim(a["dim"].name),), ONES),
                                    ParamDecl("bias", (t[0].dim(a["dim"].name),), ZEROS)], flops=_norm_flops,
               active_fraction=_reads_none,
               doc="(x - mean) * rsqrt(var + eps) * scale + bias over dim, in fp32"))


def _linear_rule(ins, attrs):
    x, over = ins[0], [d.name for d in attrs["over"]]
    for n in over:
        _sized(x, n)
    for d in attrs["out"]:  # a weight [hidden, hidden] would name one dim twice (its diagonal, as einsum reads it)
        if d.name in over or (x.dim(d.name) is not None):
            raise OpError(f"output dim `{d.name}` is already a dim of the input {x}; name it otherwise "
                          f"(e.g. `{d.name}_out`) and `rename` it back")
    return [x.with_dims(tuple(d for d in x.dims if d.name not in over) + attrs["out"])]


def _linear_params(a, types):
    over = tuple(types[0].dim(d.name) for d in a["over"])
    decls = [ParamDecl("weight", over + a["out"], NORMAL)]
    return decls + ([ParamDecl("bias", a["out"], ZEROS)] if a["bias"] else [])


register(OpDef("linear", (1, 1), (AttrDef("out", "shape"), AttrDef("over", "dims", (DimName("embed"),)),
                                  AttrDef("bias", "bool", False)),
               _linear_rule, params=_linear_params,
               flops=lambda i, o, a: 2.0 * math.prod(d.size for d in o[0].dims)
               * math.prod(i[0].dim(d.name).size for d in a["over"]), contraction=True,
               doc="x contracted over `over` with weight [over..., out...] (+ bias [out...])"))


# ---- rope, swiglu --------------------------------------------------------------------------------

# The rope family; yarn's defaults are GPT-OSS's, llama3's Llama 3.1's (a model file may leave them out).
register_struct(StructKind("rope", "rotary", (AttrDef("theta", "float", 10000.0),),
                           doc="inv_freq = theta^(-2j/head_dim)"))
register_struct(StructKind("rope", "yarn", (
    AttrDef("theta", "float", 150000.0), AttrDef("factor", "float", 32.0), AttrDef("original", "int", 4096),
    AttrDef("beta_fast", "float", 32.0), AttrDef("beta_slow", "float", 1.0), AttrDef("truncate", "bool", True)),
    doc="HF `_compute_yarn_parameters` inv_freq; cos and sin times the concentration 0.1 * ln(factor) + 1"))
register_struct(StructKind("rope", "llama3", (
    AttrDef("theta", "float", 500000.0), AttrDef("factor", "float", 8.0), AttrDef("original", "int", 8192),
    AttrDef("low_freq_factor", "float", 1.0), AttrDef("high_freq_factor", "float", 4.0)),
    doc="HF `_compute_llama3_parameters`: long wavelengths divided by factor, short kept, a blend between"))
register_struct(StructKind("rope", "rotary2d", (AttrDef("theta", "float", 100.0), AttrDef("cols", "int", 9)),
                           doc="2-D rotary for a grid in row-major order: position p is the cell (p // cols, p % cols); "
                               "the first half of the rotated pairs turn with the row, the second with the column, "
                               "each at inv_freq = theta^(-4j/head_dim); head_dim a multiple of 4"))


def _rope_fits(rope: Struct | None, head_dim: int) -> None:
    """A rope kind's demand on head_dim: even (rotate-half), a multiple of 4 for rotary2d (two halves of pairs)."""
    if rope is None:
        return
    if rope.kind == "rotary2d" and head_dim % 4:
        raise OpError(f"rope rotary2d needs a head_dim that is a multiple of 4 (row and column pairs), got {head_dim}")
    if head_dim % 2:
        raise OpError(f"rope needs an even head_dim, got {head_dim}")


def _rope_rule(ins, attrs):
    x = ins[0]
    need_float(x)
    need_dim(x, "seq")
    _rope_fits(attrs["rope"], _sized(x, "head_dim").size)
    return [x]


register(OpDef("rope", (1, 1), (AttrDef("rope", "struct:rope"),), _rope_rule,
               doc="rotate-half rotary embedding over head_dim at positions 0..seq-1 (absolute when decoding), "
                   "inv_freq and scaling by the rope kind = tessera/lower/reference/rope.py"))


def _swiglu_rule(ins, attrs):
    gate, up = ins
    need_float(gate, "gate")
    if gate.names != up.names:
        raise OpError(f"gate {gate} and up {up} must have the same dims")
    for a, b in zip(gate.dims, up.dims):
        same_size(a, b)
    return [gate]


# The act family: mlp and moe apply act(gate, up); each kind is also the primitive op of its name.
SWIGLU = register_struct(StructKind("act", "swiglu", (AttrDef("alpha", "float?", None),
                                                     AttrDef("limit", "float?", None)),
                                    doc="alpha none: silu(gate) * up. alpha set (GPT-OSS): g = min(gate, limit), "
                                        "u = clip(up, -limit, limit), out = (u + 1) * g * sigmoid(alpha * g)"))
register(OpDef(SWIGLU.name, (2, 2), SWIGLU.fields, _swiglu_rule,
               flops=lambda i, o, a: 6.0 * math.prod(d.size for d in o[0].dims), doc=SWIGLU.doc))


def _act(b, act: Struct, gate, up):
    """act(gate, up) as its kind's primitive op."""
    return b(act.kind, gate, up, **dict(act.fields))


# ---- attention -----------------------------------------------------------------------------------

def attention_pairs(s: int, window, causal: bool) -> float:
    """Visible (query, key) pairs for self-attention over s positions (mean over per-layer windows)."""
    counts = []
    for w in layer_values(window) if not isinstance(window, PerLayer) else window.values:
        if not causal:
            counts.append(float(s * s))
        elif w is None or w >= s:
            counts.append(s * (s + 1) / 2.0)
        else:  # query p sees min(p + 1, w) keys
            counts.append(w * (w + 1) / 2.0 + (s - w) * float(w))
    return sum(counts) / len(counts)


def _sdpa_rule(ins, attrs):
    q, k, v = ins[:3]
    for t, heads, what in [(q, "heads", "q"), (k, "kv_heads", "k"), (v, "kv_heads", "v")]:
        need_float(t, what)
        need_dim(t, "seq", what)
        need_dim(t, heads, what)
        same_size(need_dim(t, "head_dim", what), q.dim("head_dim"), "q, k, v")
    hq, hkv = q.dim("heads"), k.dim("kv_heads")
    if hq.size and hkv.size and hq.size % hkv.size:
        raise OpError(f"heads ({hq.size}) must be a multiple of kv_heads ({hkv.size})")
    if attrs["sinks"] != (len(ins) == 4):
        raise OpError(f"`sinks = {str(attrs['sinks']).lower()}` but {len(ins) - 3} sinks operand(s) given")
    if len(ins) == 4 and ins[3].names != ("heads",):
        raise OpError(f"sinks must be [heads], got {ins[3]}")
    return [q]


def _sdpa_flops(ins, outs, attrs):
    q = ins[0]
    per_query = math.prod(d.size for d in q.dims if d.name not in ("seq",))  # batch * heads * head_dim
    return 4.0 * per_query * attention_pairs(q.dim("seq").size, attrs["window"], attrs["causal"])


def _sdpa_primitives(b, q, k, v, sinks, *, causal, window, scale, heads: int):
    """Attention core in primitives: scores → scale → mask → softmax (with sink) → values."""
    k2 = b("repeat_kv", b("rename", k, **{"from": D("seq"), "to": D("kv_seq")}), heads=heads)  # [b, kv_seq, heads, hd]
    v2 = b("repeat_kv", b("rename", v, **{"from": D("seq"), "to": D("kv_seq")}), heads=heads)
    s = b("dot", q, k2, over=_dims("head_dim"))  # [b, seq, heads, kv_seq]
    s = b("scale", s, by=scale)
    if causal or window is not None:
        s = b("mask", s, causal=causal, window=window)
    p = b("softmax", *([s] if sinks is None else [s, sinks]), dim=D("kv_seq"))
    return b("dot", p, v2, over=_dims("kv_seq"))  # [b, seq, heads, head_dim]


def _sdpa_decompose(b, op: Op, data, params):
    """softmax(mask(scale(q·k))) · v"""
    q, k, v = data[:3]
    scale = op.attrs["scale"] if op.attrs["scale"] is not None else b.type_of(q).dim("head_dim").size ** -0.5
    return [_sdpa_primitives(b, q, k, v, data[3] if len(data) == 4 else None, causal=op.attrs["causal"],
                             window=op.attrs["window"], scale=scale, heads=b.type_of(q).dim("heads").size)]


CACHE_BLOCK = 128  # a whole-sequence cache holds a multiple of this many slots: the decode kernel's key tile


def cache_len(max_len: int, window: int | None) -> int:
    """Slots of one attention op's KV cache: the window (a ring buffer) when it is smaller than max_len,
    else max_len rounded up to CACHE_BLOCK (the slots past max_len stay empty), so the decode kernel
    reads whole key tiles without padding (copying) the cache on every step."""
    if window is not None and window <= max_len:
        return window
    return -(-max_len // CACHE_BLOCK) * CACHE_BLOCK


def _attention_state(a, dtype: str, batch: int, max_len: int) -> list[list[TensorType]]:
    """Per layer variant, its KV cache: k and v [batch, C, kv_heads, head_dim] in the compute type and the
    int32 positions [batch, C] (C = cache_len(max_len, that layer's window))."""
    variants = []
    for w in (a["window"].values if isinstance(a["window"], PerLayer) else [a["window"]]):
        c = cache_len(max_len, w)
        kv = sized_type(dtype, batch=batch, seq=c, kv_heads=a["kv_heads"], head_dim=a["head_dim"])
        variants.append([kv, kv, sized_type("i32", batch=batch, seq=c)])
    return variants


def _attention_seq_gather(a, ins: list[TensorType], dtype: str) -> list[TensorType]:
    """Keys and values of the whole sequence, projected from x [batch, seq, embed]."""
    x = ins[0]
    kv = sized_type(dtype, batch=x.dim("batch").size, seq=x.dim("seq").size, kv_heads=a["kv_heads"],
                    head_dim=a["head_dim"])
    return [kv, kv]


def _sdpa_seq_gather(a, ins: list[TensorType], dtype: str) -> list[TensorType]:
    """Keys and values of the whole sequence: its k and v operands."""
    return [ins[1], ins[2]]


_CORE_ATTRS = (AttrDef("causal", "bool", True), AttrDef("window", "int?", None, per_layer=True),
               AttrDef("scale", "float?", None), AttrDef("sinks", "bool", False))
register(OpDef("sdpa", (3, 4), _CORE_ATTRS, _sdpa_rule, flops=_sdpa_flops, contraction=True,
               decompose=_sdpa_decompose, seq_gather=_sdpa_seq_gather,
               doc="scaled dot-product attention core = tessera/lower/reference/attention.py; scale none "
                   "means head_dim^-0.5"))


def _attention_rule(ins, attrs):
    x = ins[0]
    need_float(x)
    need_dim(x, "seq")
    _sized(x, "embed")
    small = [f"{n} = {attrs[n]}" for n in ("heads", "kv_heads", "head_dim") if attrs[n] < 1]
    window = attrs["window"]
    windows = window.values if isinstance(window, PerLayer) else (window,)
    small += [f"window = {w}" for w in dict.fromkeys(windows) if w is not None and w < 1]
    if small:
        raise OpError(f"attention needs a head, a head element and a window (if any) of at least 1: "
                      f"{', '.join(small)}")
    if attrs["heads"] % attrs["kv_heads"]:
        raise OpError(f"heads ({attrs['heads']}) must be a multiple of kv_heads ({attrs['kv_heads']})")
    _rope_fits(attrs["rope"], attrs["head_dim"])
    return [x]


def _attention_params(a, types):
    e, h, kv, hd = (types[0].dim("embed"), Dim("heads", a["heads"]), Dim("kv_heads", a["kv_heads"]),
                    Dim("head_dim", a["head_dim"]))
    decls = []
    for name, heads in [("q", h), ("k", kv), ("v", kv)]:
        decls.append(ParamDecl(name, (e, heads, hd), NORMAL))
        if a["bias"]:
            decls.append(ParamDecl(f"{name}_bias", (heads, hd), ZEROS))
    decls.append(ParamDecl("o", (h, hd, e), NORMAL))
    if a["bias"]:
        decls.append(ParamDecl("o_bias", (e,), ZEROS))
    if a["sinks"]:
        decls.append(ParamDecl("sinks", (h,), ZEROS))
    return decls


def _attention_flops(ins, outs, attrs):
    x = ins[0]
    n, d = tokens(x, "embed"), x.dim("embed").size
    proj = 2.0 * n * d * attrs["head_dim"] * (2 * attrs["heads"] + 2 * attrs["kv_heads"])
    batch = n / x.dim("seq").size
    core = 4.0 * batch * attrs["heads"] * attrs["head_dim"] * attention_pairs(
        x.dim("seq").size, attrs["window"], attrs["causal"])
    return proj + core


def _attention_saved(x: TensorType, attrs: dict) -> list[tuple[TensorType, bool]]:
    """The q, k, v projections and the attention kernel's residuals (all contraction outputs)."""
    b, s, hd = x.dim("batch").size, x.dim("seq").size, attrs["head_dim"]
    h, kv = attrs["heads"], attrs["kv_heads"]
    return [(sized_type(x.dtype, batch=b, seq=s, heads=h, head_dim=hd), True),        # q projection
            (sized_type(x.dtype, batch=b, seq=s, kv_heads=kv, head_dim=hd), True),    # k projection
            (sized_type(x.dtype, batch=b, seq=s, kv_heads=kv, head_dim=hd), True),    # v projection
            # the attention kernel's residuals: kept under remat `dots` too (named, lower/context.py REMAT_SAVED)
            (sized_type(x.dtype, batch=b, seq=s, heads=h, head_dim=hd), True),        # attention output before o
            (sized_type("f32", batch=b, seq=s, heads=h), True)]                       # softmax log-sum-exp


def _attention_decompose(b, op: Op, data, p):
    """o(sdpa(rope(q(x)), rope(k(x)), v(x)))"""
    a, x = op.attrs, data[0]
    q, k, v = (_proj(b, x, p[n], p.get(f"{n}_bias"), ("embed",)) for n in ("q", "k", "v"))
    if a["rope"] is not None:  # rope on q and k only
        q, k = b("rope", q, rope=a["rope"]), b("rope", k, rope=a["rope"])
    scale = a["scale"] if a["scale"] is not None else a["head_dim"] ** -0.5
    o = _sdpa_primitives(b, q, k, v, p.get("sinks"), causal=a["causal"], window=a["window"], scale=scale,
                         heads=a["heads"])
    return [_proj(b, o, p["o"], p.get("o_bias"), ("heads", "head_dim"))]


register(OpDef("attention", (1, 1), (AttrDef("heads", "int"), AttrDef("kv_heads", "int"),
                                     AttrDef("head_dim", "int"), AttrDef("rope", "struct:rope?", None))
               + _CORE_ATTRS + (AttrDef("bias", "bool", False),),
               _attention_rule, params=_attention_params, flops=_attention_flops, contraction=True,
               saved=_attention_saved, native_split=(("*", ("heads", "kv_heads")),), decompose=_attention_decompose,
               state=_attention_state, seq_gather=_attention_seq_gather,
               doc="q/k/v projections (+bias) → rope on q, k → sdpa (GQA, causal, window, sinks) → o (+bias)"))


# ---- feed-forward --------------------------------------------------------------------------------

def _ffn_rule(ins, attrs):
    need_float(ins[0])
    _sized(ins[0], "embed")
    return [ins[0]]


def _mlp_params(a, types):
    e, f = types[0].dim("embed"), Dim("mlp", a["d_ff"])
    decls = []
    for name, dims, bias in [("gate", (e, f), (f,)), ("up", (e, f), (f,)), ("down", (f, e), (e,))]:
        decls.append(ParamDecl(name, dims, NORMAL))
        if a["bias"]:
            decls.append(ParamDecl(f"{name}_bias", bias, ZEROS))
    return decls


def _mlp_saved(x: TensorType, attrs: dict, k: int | None = None) -> list[tuple[TensorType, bool]]:
    """gate, up and the activation per token (per token and chosen expert when `k` is the MoE's top_k)."""
    b, s, f = x.dim("batch").size, x.dim("seq").size, attrs["d_ff"]
    per = dict(batch=b, seq=s) if k is None else dict(batch=b, seq=s, top_k=k)
    saved = [(sized_type(x.dtype, **per, mlp=f), True), (sized_type(x.dtype, **per, mlp=f), True),  # gate, up
             (sized_type(x.dtype, **per, mlp=f), False)]                                             # activation
    if k is not None:  # routing logits, weights and each expert's output before the weighted sum
        experts = attrs["experts"]
        saved += [(sized_type("f32", batch=b, seq=s, experts=experts), True),
                  (sized_type("f32", batch=b, seq=s, top_k=k), False),
                  (sized_type(x.dtype, **per, embed=x.dim("embed").size), True)]
    return saved


def _mlp_decompose(b, op: Op, data, p):
    """down(act(gate(x), up(x)))"""
    x = data[0]
    g, u = (_proj(b, x, p[n], p.get(f"{n}_bias"), ("embed",)) for n in ("gate", "up"))
    return [_proj(b, _act(b, op.attrs["act"], g, u), p["down"], p.get("down_bias"), ("mlp",))]


_ACT = AttrDef("act", "struct:act", Struct(SWIGLU.name, ()))
register(OpDef("mlp", (1, 1), (AttrDef("d_ff", "int"), _ACT, AttrDef("bias", "bool", False)), _ffn_rule,
               params=_mlp_params,
               flops=lambda i, o, a: 6.0 * tokens(i[0], "embed") * i[0].dim("embed").size * a["d_ff"],
               contraction=True, saved=_mlp_saved, native_split=(("*", ("mlp",)),), decompose=_mlp_decompose,
               doc="down(act(gate(x), up(x))): gate, up [embed, mlp], down [mlp, embed] (+ biases)"))


def _moe_rule(ins, attrs):
    if not 0 < attrs["top_k"] <= attrs["experts"]:
        raise OpError(f"top_k ({attrs['top_k']}) must be between 1 and experts ({attrs['experts']})")
    return _ffn_rule(ins, attrs)


def _moe_params(a, types):
    e, x, f = types[0].dim("embed"), Dim("experts", a["experts"]), Dim("mlp", a["d_ff"])
    decls = [ParamDecl("router", (e, x), NORMAL)] + ([ParamDecl("router_bias", (x,), ZEROS)] if a["bias"] else [])
    for name, dims, bias in [("gate", (x, e, f), (x, f)), ("up", (x, e, f), (x, f)), ("down", (x, f, e), (x, e))]:
        decls.append(ParamDecl(f"experts/{name}", dims, NORMAL))
        if a["bias"]:
            decls.append(ParamDecl(f"experts/{name}_bias", bias, ZEROS))
    return decls


def _moe_flops(ins, outs, attrs):  # router + top_k experts per token
    n, d = tokens(ins[0], "embed"), ins[0].dim("embed").size
    return 2.0 * n * d * attrs["experts"] + attrs["top_k"] * 6.0 * n * d * attrs["d_ff"]


def _moe_active(attrs: dict, name: str | None) -> float:
    """A token reads top_k of the experts and the whole router."""
    return attrs["top_k"] / attrs["experts"] if name and name.startswith("experts/") else 1.0


def _moe_decompose(b, op: Op, data, p):
    """Σ_experts scatter(softmax(top_k(router(x)))) * down(act(gate(x), up(x))): the dense form, every
    expert on every token, weighted by the scattered top-k softmax (zeros elsewhere)."""
    a, x = op.attrs, data[0]
    logits = _proj(b, x, p["router"], p.get("router_bias"), ("embed",))  # [b, s, experts]
    vals, idx = b.emit("top_k", [logits], k=a["top_k"], dim=D("experts"))
    weights = b("scatter", b("softmax", vals, dim=D("top_k")), idx, dim=D("experts"), size=a["experts"])
    g, u = (_proj(b, x, p[f"experts/{n}"], p.get(f"experts/{n}_bias"), ("embed",)) for n in ("gate", "up"))
    y = _proj(b, _act(b, a["act"], g, u), p["experts/down"], p.get("experts/down_bias"), ("mlp",))
    return [b("sum", b("mul", y, weights), over=_dims("experts"))]  # [b, s, embed]


register(OpDef("moe", (1, 1), (AttrDef("experts", "int"), AttrDef("top_k", "int"), AttrDef("d_ff", "int"), _ACT,
                               AttrDef("bias", "bool", True)),
               _moe_rule, params=_moe_params, flops=_moe_flops, contraction=True, active_fraction=_moe_active,
               saved=lambda x, attrs: _mlp_saved(x, attrs, attrs["top_k"]),
               native_split=(("experts/*", ("experts", "mlp")), ("router*", ())), decompose=_moe_decompose,
               doc="router logits = x @ router + bias → top_k → softmax over the k chosen → "
                   "sum_k w_k * expert_k(x), each expert an mlp with biases"))
