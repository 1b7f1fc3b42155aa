"""decompose: composite ops → primitives. One rule per composite, in the DECOMPOSE table.

Each rule gets a Builder, the op's data operands and its params by local name (`q`, `experts/gate`, ...)
and returns the values that replace the op's results. `fuse` turns these patterns back into fused ops.
"""

from __future__ import annotations

from tessera.ir.passes import register_pass
from tessera.ir.passes.rewrite import Builder, dce, regions, replace_uses
from tessera.ir.registry import get_op
from tessera.ir.types import DimName, Graph, Op, Struct
from tessera.ir.verify import split_operands

D = DimName


def _dims(*names: str) -> tuple[DimName, ...]:
    return tuple(DimName(n) for n in names)


def _proj(b: Builder, x, w, bias, over: tuple[str, ...]):
    """x contracted with w over `over`, plus bias when given."""
    y = b("dot", x, w, over=_dims(*over))
    return b("add", y, bias) if bias is not None else y


def sdpa_primitives(b: Builder, q, k, v, sinks, *, causal, window, scale, heads: int):
    """Attention core in primitives: scores → scale → mask → softmax (with sink) → values."""
    k2 = b("repeat_kv", b("rename", k, **{"from": D("seq"), "to": D("kv_seq")}), heads=heads)  # [b, kv_seq, heads, hd]
    v2 = b("repeat_kv", b("rename", v, **{"from": D("seq"), "to": D("kv_seq")}), heads=heads)
    s = b("dot", q, k2, over=_dims("head_dim"))  # [b, seq, heads, kv_seq]
    s = b("scale", s, by=scale)
    if causal or window is not None:
        s = b("mask", s, causal=causal, window=window)
    p = b("softmax", *([s] if sinks is None else [s, sinks]), dim=D("kv_seq"))
    return b("dot", p, v2, over=_dims("kv_seq"))  # [b, seq, heads, head_dim]


def _sdpa(b: Builder, op: Op, data, params):
    q, k, v = data[:3]
    scale = op.attrs["scale"] if op.attrs["scale"] is not None else b.type_of(q).dim("head_dim").size ** -0.5
    return [sdpa_primitives(b, q, k, v, data[3] if len(data) == 4 else None, causal=op.attrs["causal"],
                            window=op.attrs["window"], scale=scale, heads=b.type_of(q).dim("heads").size)]


def _attention(b: Builder, op: Op, data, p):
    a, x = op.attrs, data[0]
    q, k, v = (_proj(b, x, p[n], p.get(f"{n}_bias"), ("embed",)) for n in ("q", "k", "v"))
    if a["rope"] is not None:  # rope on q and k only
        q, k = b("rope", q, rope=a["rope"]), b("rope", k, rope=a["rope"])
    scale = a["scale"] if a["scale"] is not None else a["head_dim"] ** -0.5
    o = sdpa_primitives(b, q, k, v, p.get("sinks"), causal=a["causal"], window=a["window"], scale=scale,
                        heads=a["heads"])
    return [_proj(b, o, p["o"], p.get("o_bias"), ("heads", "head_dim"))]


def _act(b: Builder, act: Struct, gate, up):
    return b("swiglu", gate, up, alpha=act.get("alpha"), limit=act.get("limit"))


def _mlp(b: Builder, op: Op, data, p):
    x = data[0]
    g, u = (_proj(b, x, p[n], p.get(f"{n}_bias"), ("embed",)) for n in ("gate", "up"))
    return [_proj(b, _act(b, op.attrs["act"], g, u), p["down"], p.get("down_bias"), ("mlp",))]


def _moe(b: Builder, op: Op, data, p):
    # dense form: every expert on every token, weighted by the scattered top-k softmax (zeros elsewhere)
    a, x = op.attrs, data[0]
    logits = _proj(b, x, p["router"], p.get("router_bias"), ("embed",))  # [b, s, experts]
    vals, idx = b.emit("top_k", [logits], k=a["top_k"], dim=D("experts"))
    weights = b("scatter", b("softmax", vals, dim=D("top_k")), idx, dim=D("experts"), size=a["experts"])
    g, u = (_proj(b, x, p[f"experts/{n}"], p.get(f"experts/{n}_bias"), ("embed",)) for n in ("gate", "up"))
    y = _proj(b, _act(b, a["act"], g, u), p["experts/down"], p.get("experts/down_bias"), ("mlp",))
    return [b("sum", b("mul", y, weights), over=_dims("experts"))]  # [b, s, embed]


DECOMPOSE = {
    "attention": _attention,  # o(sdpa(rope(q(x)), rope(k(x)), v(x)))
    "sdpa": _sdpa,            # softmax(mask(scale(q·k))) · v
    "mlp": _mlp,              # down(act(gate(x), up(x)))
    "moe": _moe,              # Σ_experts scatter(softmax(top_k(router(x)))) * down(act(gate(x), up(x)))
}


def local_params(op: Op, decls) -> dict:
    """The op's param operands by the names their decls give (`q`, `experts/gate`)."""
    _, owned = split_operands(op, get_op(op.name))
    return {d.name: ref for d, ref in zip(decls, owned)}


def decompose(graph: Graph, ctx) -> Graph:
    """Replace every composite op that has a rule with its primitives."""
    mapping = {}
    for region, axes in regions(graph):
        new_ops = []
        for op in region.ops:
            rule = DECOMPOSE.get(op.name)
            if rule is None:
                new_ops.append(op)
                continue
            b = Builder(graph, axes, op.span)
            opdef = get_op(op.name)
            data, _ = split_operands(op, opdef)
            decls = opdef.params(op.attrs, [b.type_of(o) for o in data])
            outs = rule(b, op, data, local_params(op, decls))
            new_ops += b.ops
            mapping.update((r.id, o) for r, o in zip(op.results, outs))
        region.ops = new_ops
    replace_uses(graph, mapping)
    return dce(graph)


register_pass("decompose", decompose)
