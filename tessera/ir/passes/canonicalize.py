"""canonicalize: fold attributes to constants, remove identities, CSE, DCE.

Folding rules are a table of (op names, fn(op, types) -> new attrs or None); identity rules a table of
(op name, predicate) whose op is replaced by its first operand.
"""

from __future__ import annotations

from tessera.ir.passes import register_pass
from tessera.ir.passes.rewrite import dce, definitions, regions, replace_uses
from tessera.ir.printer import format_attr
from tessera.ir.types import Graph, Op, PerLayer, Value


def _uniform_per_layer(op: Op, types) -> dict | None:
    # per_layer[a, a, ..., a] → a
    new = {k: v.values[0] if isinstance(v, PerLayer) and len(set(v.values)) == 1 else v for k, v in op.attrs.items()}
    return new if new != op.attrs else None


def _default_scale(op: Op, types) -> dict | None:
    # attention scale none → head_dim^-0.5 (what the reference uses)
    if op.attrs.get("scale", 0.0) is not None:
        return None
    hd = op.attrs["head_dim"] if op.name == "attention" else types[0].dim("head_dim").size
    return {**op.attrs, "scale": hd ** -0.5}


FOLDS = [
    (("*",), _uniform_per_layer),
    (("attention", "sdpa"), _default_scale),
]

IDENTITIES = [
    ("scale", lambda op: op.attrs["by"] == 1.0),  # scale(x, 1) → x
    ("transpose", lambda op: tuple(d.name for d in op.attrs["to"]) == op.values[0].type.names
     if isinstance(op.operands[0], Value) else False),  # transpose to the same order → x
]


def _fold(graph: Graph) -> None:
    for region, _ in regions(graph):
        for op in region.ops:
            types = [o.type for o in op.values]
            for names, fn in FOLDS:
                if "*" in names or op.name in names:
                    new = fn(op, types)
                    if new is not None:
                        op.attrs = new


def _identities(graph: Graph) -> None:
    mapping = {}
    for region, _ in regions(graph):
        for op in region.ops:
            for name, pred in IDENTITIES:
                if op.name == name and pred(op) and isinstance(op.operands[0], Value):
                    mapping[op.result.id] = op.operands[0]
    replace_uses(graph, mapping)


def _merge_scales(graph: Graph) -> None:
    # scale(scale(x, a), b) → scale(x, a * b)
    defs = definitions(graph)
    for region, _ in regions(graph):
        for op in region.ops:
            inner = defs.get(op.operands[0].id) if op.name == "scale" and isinstance(op.operands[0], Value) else None
            if inner is not None and inner.name == "scale" and not any(
                    isinstance(o.attrs["by"], PerLayer) for o in (op, inner)):
                op.operands = [inner.operands[0]]
                op.attrs = {"by": inner.attrs["by"] * op.attrs["by"]}


def _cse(graph: Graph) -> None:
    """Ops with the same name, operands and attributes (and no region) compute the same value."""
    mapping: dict[int, Value] = {}
    for region, _ in regions(graph):
        seen: dict[tuple, Op] = {}
        for op in region.ops:
            op.operands = [mapping.get(o.id, o) if isinstance(o, Value) else o for o in op.operands]
            if op.region is not None:
                continue
            key = (op.name, tuple(o.id if isinstance(o, Value) else o.path for o in op.operands),
                   tuple((k, format_attr(v)) for k, v in op.attrs.items()))
            if key in seen:
                mapping.update((r.id, s) for r, s in zip(op.results, seen[key].results))
            else:
                seen[key] = op
        region.outputs = [mapping.get(v.id, v) for v in region.outputs]
    replace_uses(graph, mapping)


def canonicalize(graph: Graph, ctx) -> Graph:
    """Fold attributes, drop identities, merge scales, CSE, DCE."""
    _fold(graph)
    _merge_scales(graph)
    _identities(graph)
    _cse(graph)
    return dce(graph)


register_pass("canonicalize", canonicalize)
