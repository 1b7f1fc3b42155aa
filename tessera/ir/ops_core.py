"""Primitive ops: elementwise math, activations, named-dim contraction, softmax, masks, reshapes, top-k.

Named-dim conventions: a contraction or broadcast matches dims by name; the result keeps the first
operand's dims in order and appends the second operand's new dims. Reference semantics (what each
lowering must compute) are in each op's `doc`.
"""

from __future__ import annotations

import math

from tessera.ir.registry import AttrDef, OpDef, OpError, register
from tessera.ir.types import Dim, DimName, TensorType, is_float


# ---- helpers shared by type rules ----------------------------------------------------------------

def need_dim(t: TensorType, name: str, what: str = "operand") -> Dim:
    """The dim `name` of `t`, or an error naming the operand's type."""
    d = t.dim(name)
    if d is None:
        raise OpError(f"{what} {t} has no dimension `{name}`")
    return d


def need_float(t: TensorType, what: str = "operand") -> None:
    if not is_float(t.dtype):
        raise OpError(f"{what} must be floating point, got {t}")


def same_size(a: Dim, b: Dim, what: str = "operands") -> None:
    """Two dims of one name must agree on size when both are known."""
    if a.size is not None and b.size is not None and a.size != b.size:
        raise OpError(f"dimension `{a.name}` is {a.size} in one of the {what} but {b.size} in the other")


def broadcast(a: TensorType, b: TensorType) -> TensorType:
    """Broadcast by name: a's dims, then b's dims a lacks; shared dims must agree."""
    for d in b.dims:
        if a.dim(d.name) is not None:
            same_size(a.dim(d.name), d)
    return a.with_dims(a.dims + tuple(d for d in b.dims if a.dim(d.name) is None))


def tokens(t: TensorType, *feature_dims: str) -> float:
    """Number of positions in `t` outside `feature_dims` (all dims sized)."""
    return float(math.prod(d.size for d in t.dims if d.name not in feature_dims))


def _numel(t: TensorType) -> float:
    return float(math.prod(d.size for d in t.dims))


# ---- elementwise ---------------------------------------------------------------------------------

_COMPLEX = {"c64": "f32", "c128": "f64"}  # complex type -> its parts' type


def _binary_rule(ins, attrs):
    a, b = ins
    need_float(a, "first operand")
    out = broadcast(a, b)
    if b.dtype in _COMPLEX and a.dtype not in _COMPLEX:  # real with complex: complex (of the real's precision)
        if _COMPLEX[b.dtype] != a.dtype:
            raise OpError(f"a complex operand {b} needs a real one of its parts' type {_COMPLEX[b.dtype]}, got {a}")
        out = out.with_dtype(b.dtype)
    elif a.dtype in _COMPLEX and b.dtype not in _COMPLEX and is_float(b.dtype) and _COMPLEX[a.dtype] != b.dtype:
        raise OpError(f"a complex operand {a} needs a real one of its parts' type {_COMPLEX[a.dtype]}, got {b}")
    return [out]


def _unary_rule(ins, attrs):
    need_float(ins[0])
    return [ins[0]]


def _elementwise_flops(ins, outs, attrs):
    return _numel(outs[0])


for _name, _doc in [("add", "a + b"), ("sub", "a - b"), ("mul", "a * b"), ("div", "a / b"),
                    ("maximum", "max(a, b)")]:
    register(OpDef(_name, (2, 2), (), _binary_rule, flops=_elementwise_flops,
                   doc=f"{_doc}, broadcast by dim name (result: a's dims, then b's new dims)"))

for _name, _doc in [("silu", "x * sigmoid(x)"), ("sigmoid", "1 / (1 + exp(-x))"), ("exp", "exp(x)"),
                    ("neg", "-x"), ("tanh", "tanh(x)"), ("softplus", "log(1 + exp(x)), computed stably")]:
    register(OpDef(_name, (1, 1), (), _unary_rule, flops=_elementwise_flops, doc=_doc))

register(OpDef("gelu", (1, 1), (AttrDef("approximate", "bool", False),), _unary_rule,
               flops=_elementwise_flops, doc="exact erf gelu, or the tanh approximation"))
register(OpDef("scale", (1, 1), (AttrDef("by", "float", per_layer=True),), _unary_rule, flops=_elementwise_flops,
               doc="x * by (a compile-time constant)"))


# ---- contraction, reductions ---------------------------------------------------------------------

def _dot_rule(ins, attrs):
    a, b = ins
    over = [d.name for d in attrs["over"]]
    if not over:
        raise OpError("`over` must name at least one dimension to contract")
    for name in over:
        same_size(need_dim(a, name, "first operand"), need_dim(b, name, "second operand"))
    for d in b.dims:
        if d.name not in over and a.dim(d.name) is not None:
            same_size(a.dim(d.name), d)
    dims = [d for d in a.dims if d.name not in over]
    dims += [d for d in b.dims if d.name not in over and a.dim(d.name) is None]
    return [TensorType(b.dtype if b.dtype in _COMPLEX and a.dtype not in _COMPLEX else a.dtype, tuple(dims))]


def _dot_flops(ins, outs, attrs):
    over = math.prod(ins[0].dim(d.name).size for d in attrs["over"])
    complex_ = 4.0 if outs[0].dtype in _COMPLEX else 1.0  # a complex product is 4 real ones (and their sums)
    return 2.0 * _numel(outs[0]) * over * complex_


register(OpDef("dot", (2, 2), (AttrDef("over", "dims"),), _dot_rule, flops=_dot_flops, contraction=True,
               doc="sum over `over` of a * b; dims shared but not contracted are batch dims"))


def _sum_rule(ins, attrs):
    names = [d.name for d in attrs["over"]]
    for n in names:
        need_dim(ins[0], n)
    return [ins[0].with_dims(d for d in ins[0].dims if d.name not in names)]


register(OpDef("sum", (1, 1), (AttrDef("over", "dims"),), _sum_rule,
               flops=lambda i, o, a: _numel(i[0]), doc="sum over the named dims"))


def _softmax_rule(ins, attrs):
    x = ins[0]
    need_float(x)
    dim = need_dim(x, attrs["dim"].name)
    if len(ins) == 2:  # sink: one extra logit per row, broadcast over the rest, no value
        for d in ins[1].dims:
            if d.name == dim.name or x.dim(d.name) is None:
                raise OpError(f"sink {ins[1]} must use only dims of {x} other than `{dim.name}`")
            same_size(x.dim(d.name), d)
    return [x]


register(OpDef("softmax", (1, 2), (AttrDef("dim", "dim"),), _softmax_rule,
               flops=lambda i, o, a: 5.0 * _numel(i[0]),
               doc="softmax over `dim` in fp32; an optional sink operand joins the denominator only"))


def _mask_rule(ins, attrs):
    x = ins[0]
    need_dim(x, attrs["q"].name)
    need_dim(x, attrs["k"].name)
    return [x]


register(OpDef("mask", (1, 1), (AttrDef("causal", "bool", True), AttrDef("window", "int?", None, per_layer=True),
                                AttrDef("q", "dim", DimName("seq")), AttrDef("k", "dim", DimName("kv_seq"))),
               _mask_rule,
               doc="-inf where key k is not visible from query q: causal k <= q; window q - k < window"))


# ---- dims: rename, repeat_kv, transpose, reshape ------------------------------------------------

def _rename_rule(ins, attrs):
    x, src, dst = ins[0], attrs["from"].name, attrs["to"].name
    need_dim(x, src)
    if x.dim(dst) is not None:
        raise OpError(f"operand {x} already has a dimension `{dst}`")
    return [x.with_dims(Dim(dst, d.size) if d.name == src else d for d in x.dims)]


register(OpDef("rename", (1, 1), (AttrDef("from", "dim"), AttrDef("to", "dim")), _rename_rule,
               doc="the same tensor with one dim renamed"))


def _repeat_kv_rule(ins, attrs):
    x, heads = ins[0], attrs["heads"]
    kv = need_dim(x, "kv_heads")
    if kv.size is not None and heads % kv.size:
        raise OpError(f"heads ({heads}) must be a multiple of kv_heads ({kv.size})")
    return [x.with_dims(Dim("heads", heads) if d.name == "kv_heads" else d for d in x.dims)]


register(OpDef("repeat_kv", (1, 1), (AttrDef("heads", "int"),), _repeat_kv_rule,
               doc="kv_heads → heads: query head h reads kv head h // (heads // kv_heads)"))


def _transpose_rule(ins, attrs):
    x, to = ins[0], [d.name for d in attrs["to"]]
    if sorted(to) != sorted(x.names):
        raise OpError(f"`to` {to} must be a permutation of the dims of {x}")
    return [x.with_dims(x.dim(n) for n in to)]


register(OpDef("transpose", (1, 1), (AttrDef("to", "dims"),), _transpose_rule, doc="reorder dims by name"))


def _reshape_rule(ins, attrs):
    x, src, to = ins[0], [d.name for d in attrs["from"]], attrs["to"]
    idx = [x.names.index(need_dim(x, n).name) for n in src]
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise OpError(f"`from` {src} must be adjacent dims of {x}, in order")
    n_from = math.prod(x.dims[i].size or 0 for i in idx)
    if n_from != math.prod(d.size for d in to):
        raise OpError(f"cannot reshape {src} ({n_from} elements) into {[str(d) for d in to]}")
    return [x.with_dims(x.dims[:idx[0]] + tuple(to) + x.dims[idx[-1] + 1:])]


register(OpDef("reshape", (1, 1), (AttrDef("from", "dims"), AttrDef("to", "shape")), _reshape_rule,
               doc="replace adjacent dims `from` by `to` (row-major split / merge)"))


# ---- selection -----------------------------------------------------------------------------------

def _top_k_rule(ins, attrs):
    x, k = ins[0], attrs["k"]
    d = need_dim(x, attrs["dim"].name)
    if d.size is not None and not 0 < k <= d.size:
        raise OpError(f"k = {k} must be between 1 and the size of `{d.name}` ({d.size})")
    dims = tuple(Dim("top_k", k) if e.name == d.name else e for e in x.dims)
    return [x.with_dims(dims), TensorType("i32", dims)]


register(OpDef("top_k", (1, 1), (AttrDef("k", "int"), AttrDef("dim", "dim")), _top_k_rule,
               doc="the k largest entries along `dim` (descending) and their indices; new dim `top_k`"))


def _scatter_rule(ins, attrs):
    vals, idx = ins
    need_dim(vals, "top_k", "values")
    if idx.names != vals.names or is_float(idx.dtype):
        raise OpError(f"indices must be integers with the dims of the values {vals}, got {idx}")
    return [vals.with_dims(Dim(attrs["dim"].name, attrs["size"]) if d.name == "top_k" else d for d in vals.dims)]


register(OpDef("scatter", (2, 2), (AttrDef("dim", "dim"), AttrDef("size", "int")), _scatter_rule,
               doc="dense tensor with dim `dim` of `size`: values at their indices along top_k, zeros elsewhere"))


def _cross_entropy_rule(ins, attrs):
    logits, labels = ins
    need_float(logits, "logits")
    vocab = attrs["dim"].name
    need_dim(logits, vocab, "logits")
    if is_float(labels.dtype) or labels.names != tuple(n for n in logits.names if n != vocab):
        raise OpError(f"labels must be integers with the dims of the logits but `{vocab}`, got {labels}")
    return [TensorType("f32", ())]


register(OpDef("cross_entropy", (2, 2), (AttrDef("dim", "dim", DimName("vocab")),), _cross_entropy_rule,
               flops=lambda i, o, a: 4.0 * _numel(i[0]),
               doc="mean over positions of -log softmax(logits)[label], in fp32"))


# Per-position losses and scores, for objectives kept per sample (a recurrence's segments, each sample halting on
# its own, add their losses into a per-sample carried value): the loss entries of models/hrm.tsl.

def _token_cross_entropy_rule(ins, attrs):
    _cross_entropy_rule(ins, attrs)
    return [TensorType("f32", ins[1].dims)]


register(OpDef("token_cross_entropy", (2, 2), (AttrDef("dim", "dim", DimName("vocab")),), _token_cross_entropy_rule,
               flops=lambda i, o, a: 4.0 * _numel(i[0]),
               doc="-log softmax(logits)[label] at every position (the labels' dims), in fp32"))


def _exact_match_rule(ins, attrs):
    _cross_entropy_rule(ins, attrs)
    labels, over = ins[1], [d.name for d in attrs["over"]]
    for n in over:
        need_dim(labels, n, "labels")
    return [TensorType("f32", tuple(d for d in labels.dims if d.name not in over))]


register(OpDef("exact_match", (2, 2), (AttrDef("dim", "dim", DimName("vocab")), AttrDef("over", "dims")),
               _exact_match_rule, flops=lambda i, o, a: _numel(i[0]),
               doc="1.0 where the argmax of the logits over `dim` equals the label at every position of `over`, "
                   "else 0.0 (f32, the labels' dims but `over`; no gradient): whether a prediction is entirely right"))
