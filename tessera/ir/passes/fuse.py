"""fuse: primitive patterns → fused ops. Rules are a table of (root op, matcher); a matcher walks up
from the root through single-use values and returns the fused op's (name, operands, attrs) or None.

The patterns are exactly what `decompose` writes (and what a person writes by hand in primitives):
  sdpa:      dot(softmax(mask(scale(dot(q, repeat_kv(rename(k))))) [, sinks]), repeat_kv(rename(v)))
  attention: [add(] dot(sdpa(rope?(q(x)), rope?(k(x)), v(x) [, @s/sinks]), @s/o) [, @s/o_bias)]
  mlp:       [add(] dot(act(gate(x), up(x)), @s/down) [, @s/down_bias)]
  moe:       sum(mul(down(act(gate(x), up(x))), scatter(softmax(top_k(router(x))))), over=[experts])
where f(x) means dot(x, @s/f) optionally followed by add(·, @s/f_bias), and act is the op of an `act` kind
(swiglu), whose attributes become the kind's fields.
"""

from __future__ import annotations

from tessera.ir.passes import register_pass
from tessera.ir.passes.rewrite import Builder, dce, definitions, regions, replace_uses, use_counts
from tessera.ir.registry import struct_families
from tessera.ir.types import Graph, Op, ParamRef, Struct, Value


class _Match:
    """Look-ups over one graph: the op defining a single-use value, by name."""

    def __init__(self, graph: Graph):
        self.defs, self.uses = definitions(graph), use_counts(graph)

    def op(self, v, name: str, over: tuple[str, ...] | None = None, single: bool = True) -> Op | None:
        if not isinstance(v, Value):
            return None
        op = self.defs.get(v.id)
        if op is None or op.name != name or (single and self.uses.get(v.id, 0) != 1):
            return None
        if over is not None and tuple(d.name for d in op.attrs["over"]) != over:
            return None
        return op

    def proj(self, v, over: tuple[str, ...], single: bool = True):
        """v = dot(x, @s/w, over) [+ @s/w_bias] → (x, weight ref, bias ref or None)."""
        bias = None
        add = self.op(v, "add", single=single)
        if add is not None and isinstance(add.operands[1], ParamRef):
            v, bias = add.operands
        dot = self.op(v, "dot", over)
        if dot is None or not isinstance(dot.operands[1], ParamRef):
            return None
        w = dot.operands[1]
        if bias is not None and bias.path != w.path + "_bias":
            return None
        return dot.operands[0], w, bias


def _scope(ref: ParamRef, name: str) -> str | None:
    return ref.path[: -len(name) - 1] if ref.path.endswith("/" + name) else None


def _kv(m: _Match, v):
    rk = m.op(v, "repeat_kv")
    rn = m.op(rk.operands[0], "rename") if rk else None
    if rn is None or (rn.attrs["from"].name, rn.attrs["to"].name) != ("seq", "kv_seq"):
        return None
    return rn.operands[0]


def match_sdpa(m: _Match, root: Op):
    p, vv = root.operands
    if tuple(d.name for d in root.attrs["over"]) != ("kv_seq",):
        return None
    sm = m.op(p, "softmax")
    if sm is None or sm.attrs["dim"].name != "kv_seq":
        return None
    s, causal, window = sm.operands[0], False, None
    mask = m.op(s, "mask")
    if mask is not None:
        s, causal, window = mask.operands[0], mask.attrs["causal"], mask.attrs["window"]
    scale = 1.0
    sc = m.op(s, "scale")
    if sc is not None:
        s, scale = sc.operands[0], sc.attrs["by"]
    qk = m.op(s, "dot", ("head_dim",))
    k, v = (_kv(m, qk.operands[1]) if qk else None), _kv(m, vv)
    if k is None or v is None:
        return None
    sinks = sm.operands[1:]
    attrs = dict(causal=causal, window=window, scale=scale, sinks=bool(sinks))
    return "sdpa", [qk.operands[0], k, v, *sinks], attrs


def match_attention(m: _Match, root: Op):
    out = m.proj(root.result, ("heads", "head_dim"), single=False) if root.name == "add" else None
    if root.name == "dot":
        out = (root.operands[0], root.operands[1], None) if isinstance(root.operands[1], ParamRef) else None
        if tuple(d.name for d in root.attrs["over"]) != ("heads", "head_dim"):
            return None
    if out is None:
        return None
    o, wo, bo = out
    s = _scope(wo, "o")
    core = m.op(o, "sdpa")
    if s is None or core is None:
        return None
    qkv, ropes = [], []
    for k, v in enumerate(core.operands[:3]):
        r = m.op(v, "rope") if k < 2 else None  # rope on q and k, the same on both
        ropes.append(None if r is None else r.attrs["rope"])
        v = v if r is None else r.operands[0]
        proj = m.proj(v, ("embed",))
        if proj is None or proj[1].path != f"{s}/{'qkv'[k]}" or (proj[2] is None) != (bo is None):
            return None
        qkv.append(proj)
    sinks, rope = core.operands[3:], ropes[0]
    if ropes[0] != ropes[1] or len({id(x) for x, _, _ in qkv}) != 1 or any(p.path != f"{s}/sinks" for p in sinks):
        return None
    params = [r for _, w, b in qkv for r in (w, b) if r is not None] + [wo] + ([bo] if bo else []) + list(sinks)
    t = {p.path.rsplit("/", 1)[1]: p for p in params}
    attrs = dict(heads=None, kv_heads=None, head_dim=None, rope=rope, **{a: core.attrs[a] for a in
                 ("causal", "window", "scale", "sinks")}, bias=bo is not None)
    return "attention", [qkv[0][0]] + params, attrs | {"_shape_from": (t["q"], t["k"])}


def _mlp_like(m: _Match, h, prefix: str, over_in: tuple[str, ...]):
    act = next(filter(None, (m.op(h, kind) for kind in struct_families()["act"])), None)
    if act is None:
        return None
    g, u = m.proj(act.operands[0], over_in), m.proj(act.operands[1], over_in)
    if g is None or u is None or g[0] is not u[0] or not g[1].path.endswith(f"{prefix}gate") \
            or u[1].path != g[1].path[:-4] + "up":
        return None
    return g, u, Struct(act.name, tuple(act.attrs.items()))


def match_mlp(m: _Match, root: Op):
    down = m.proj(root.result, ("mlp",), single=False) if root.name == "add" else None
    if root.name == "dot" and isinstance(root.operands[1], ParamRef):
        down = (root.operands[0], root.operands[1], None) if tuple(d.name for d in root.attrs["over"]) == ("mlp",) \
            else None
    if down is None or _scope(down[1], "down") is None or "/experts/" in "/" + down[1].path:
        return None
    found = _mlp_like(m, down[0], "", ("embed",))
    if found is None:
        return None
    (x, wg, bg), (_, wu, bu), act = found
    if _scope(wg, "gate") != _scope(down[1], "down") or (bg is None) != (down[2] is None):
        return None
    params = [r for r in (wg, bg, wu, bu, down[1], down[2]) if r is not None]
    return "mlp", [x] + params, dict(d_ff=None, act=act, bias=down[2] is not None, _shape_from=(wg,))


def match_moe(m: _Match, root: Op):
    mul = m.op(root.operands[0], "mul")
    if tuple(d.name for d in root.attrs["over"]) != ("experts",) or mul is None:
        return None
    y, weights = mul.operands
    down, sc = m.proj(y, ("mlp",)), m.op(weights, "scatter")
    if down is None or sc is None or _scope(down[1], "experts/down") is None:
        return None
    s = _scope(down[1], "experts/down")
    sm = m.op(sc.operands[0], "softmax")
    tk = m.op(sm.operands[0], "top_k") if sm else None
    if tk is None or sc.operands[1] is not tk.results[1] or m.uses.get(tk.results[1].id) != 1:
        return None
    router = m.proj(tk.operands[0], ("embed",))
    found = _mlp_like(m, down[0], "experts/", ("embed",))
    if router is None or found is None or router[1].path != f"{s}/router":
        return None
    (x, wg, bg), (_, wu, bu), act = found
    if x is not router[0] or _scope(wg, "experts/gate") != s:
        return None
    params = [r for r in (router[1], router[2], wg, bg, wu, bu, down[1], down[2]) if r is not None]
    return "moe", [x] + params, dict(experts=sc.attrs["size"], top_k=tk.attrs["k"], d_ff=None, act=act,
                                     bias=down[2] is not None, _shape_from=(wg,))


FUSE = [
    ("dot", match_sdpa),        # softmax(mask(scale(q·k))) · v → sdpa(q, k, v)
    ("dot", match_attention),   # o(sdpa(rope(q(x)), rope(k(x)), v(x))) → attention(x)
    ("add", match_attention),   #   ... with biases
    ("dot", match_mlp),         # down(act(gate(x), up(x))) → mlp(x)
    ("add", match_mlp),         #   ... with biases
    ("sum", match_moe),         # Σ_experts weights * experts(x) → moe(x)
]


def _sizes(b: Builder, attrs: dict) -> dict:
    """Fill the size attributes a fused op needs from its params' types."""
    refs = attrs.pop("_shape_from")
    t = [b.type_of(r) for r in refs]
    if "heads" in attrs:
        attrs.update(heads=t[0].dim("heads").size, kv_heads=t[1].dim("kv_heads").size,
                     head_dim=t[0].dim("head_dim").size)
    if "d_ff" in attrs:
        attrs["d_ff"] = t[0].dim("mlp").size
    return attrs


def fuse(graph: Graph, ctx) -> Graph:
    """Apply the FUSE rules in order, each to a fixed point over the whole graph."""
    for root_name, matcher in FUSE:
        while True:
            m, done = _Match(graph), True
            for region, axes in regions(graph):
                for k, op in enumerate(region.ops):
                    found = matcher(m, op) if op.name == root_name else None
                    if found is None:
                        continue
                    name, operands, attrs = found
                    b = Builder(graph, axes, op.span)
                    n_data = 1 if name != "sdpa" else None
                    if "_shape_from" in attrs:
                        attrs = _sizes(b, attrs)
                    new = b.emit(name, operands, n_data, **attrs)
                    region.ops[k:k] = b.ops
                    replace_uses(graph, {op.result.id: new[0]})
                    done = False
                    break
                if not done:
                    break
            dce(graph)
            if done:
                break
    return graph


register_pass("fuse", fuse)
