"""Tools shared by rewriting passes: building ops with inferred types, use counts, replacement, DCE, retyping."""

from __future__ import annotations

from typing import Iterator

from tessera.ir.registry import check_attrs, get_op
from tessera.ir.types import Graph, Op, ParamRef, Region, TensorType, Value
from tessera.ir.verify import param_type


class Builder:
    """Emits ops (types from the registry's type rules) into a list, for splicing into a region."""

    def __init__(self, graph: Graph, axes: list[tuple[str, int]], span=None):
        self.graph, self.axes, self.span = graph, axes, span
        self.ops: list[Op] = []

    def type_of(self, operand) -> TensorType:
        return param_type(self.graph, operand.path, self.axes) if isinstance(operand, ParamRef) else operand.type

    def emit(self, name: str, operands: list, n_data: int | None = None, **attrs) -> list[Value]:
        """Append `name(operands) {attrs}`; the first `n_data` operands (default all) are typed data."""
        opdef = get_op(name)
        attrs = check_attrs(opdef, attrs)
        data = operands if n_data is None else operands[:n_data]
        results = [Value(t) for t in opdef.type_rule([self.type_of(o) for o in data], attrs)]
        self.ops.append(Op(name, list(operands), attrs, results, None, self.span))
        return results

    def __call__(self, name: str, *operands, **attrs) -> Value:
        """Emit a single-result primitive and return its result."""
        return self.emit(name, list(operands), **attrs)[0]


def regions(graph: Graph) -> Iterator[tuple[Region, list[tuple[str, int]]]]:
    """Every region with the repeat axes around it (outermost first): the body first, the regions of loops,
    derivatives and their second regions (adjoints, halting conditions: no axis of their own), then each loss's
    region."""
    def walk(region, axes):
        yield region, axes
        for op in region.ops:
            if op.region is not None:
                yield from walk(op.region, axes + op.stacking)
            if op.second is not None:
                yield from walk(op.second, axes)
    yield from walk(graph.body, [])
    for loss in graph.losses:
        yield from walk(loss.region, [])




def use_counts(graph: Graph) -> dict[int, int]:
    """How many times each value id is used (operands and region outputs)."""
    counts: dict[int, int] = {}
    for region, _ in regions(graph):
        for op in region.ops:
            for o in op.operands:
                if isinstance(o, Value):
                    counts[o.id] = counts.get(o.id, 0) + 1
        for v in region.outputs:
            counts[v.id] = counts.get(v.id, 0) + 1
    return counts


def definitions(graph: Graph) -> dict[int, Op]:
    """The op defining each op-result value id."""
    return {r.id: op for region, _ in regions(graph) for op in region.ops for r in op.results}


def replace_uses(graph: Graph, mapping: dict[int, Value]) -> None:
    """Replace every use of value ids in `mapping` with the mapped value."""
    if not mapping:
        return
    for region, _ in regions(graph):
        for op in region.ops:
            op.operands = [mapping.get(o.id, o) if isinstance(o, Value) else o for o in op.operands]
        region.outputs = [mapping.get(v.id, v) for v in region.outputs]


def dce(graph: Graph) -> Graph:
    """Drop ops whose results are unused (all ops are pure), then params nothing reads."""
    changed = True
    while changed:
        counts = use_counts(graph)
        changed = False
        for region, _ in regions(graph):
            keep = [op for op in region.ops if any(counts.get(r.id, 0) for r in op.results)]
            changed |= len(keep) != len(region.ops)
            region.ops = keep
    used = {o.path for region, _ in regions(graph) for op in region.ops for o in op.operands
            if isinstance(o, ParamRef)}
    graph.params = {p: v for p, v in graph.params.items() if p in used}
    return graph


def _region_args(op: Op, types: list) -> list[list[TensorType]]:
    """The argument types of each of an op's regions (the first, then the second) from its operand types."""
    rule = get_op(op.name).region_args
    return rule(types, op) if rule is not None else [list(types), list(types)]


def retype(graph: Graph) -> Graph:
    """Recompute every result type from operand types with the type rules (after dtype changes)."""
    from tessera.ir.verify import split_operands

    def walk(region: Region, axes):
        for op in region.ops:
            opdef = get_op(op.name)
            data, _ = split_operands(op, opdef)
            types = [param_type(graph, o.path, axes) if isinstance(o, ParamRef) else o.type for o in data]
            if op.region is not None:
                for a, t in zip(op.region.args, _region_args(op, types)[0]):
                    a.type = t
                walk(op.region, axes + op.stacking)
            if op.second is not None:  # typed after the first: an adjoint's arguments include the block's result
                for a, t in zip(op.second.args, _region_args(op, types)[1]):
                    a.type = t
                walk(op.second, axes)
            out = opdef.region_rule(types, op.attrs, op) if opdef.region_rule else opdef.type_rule(types, op.attrs)
            for r, t in zip(op.results, out):
                r.type = t
    walk(graph.body, [])
    for loss in graph.losses:
        walk(loss.region, [])
    return graph
