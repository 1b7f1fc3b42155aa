"""Forward FLOPs from the IR: each OpDef's `flops` hook on concrete types (dynamic dims filled in).

MoE counts only the top_k experts each token visits; attention counts only visible (query, key) pairs,
averaged over per-layer windows. Ops inside a repeat count once per layer, inside a loop once per step up to its
cap (a loop that halts early costs less than counted).
"""

from __future__ import annotations

from tessera.ir.registry import get_op
from tessera.ir.types import Dim, Graph, Op, ParamRef, TensorType
from tessera.ir.verify import param_type, split_operands


def _concrete(t: TensorType, sizes: dict) -> TensorType:
    dims = []
    for d in t.dims:
        size = d.size if d.size is not None else sizes.get(d.name)
        if size is None:
            raise ValueError(f"the size of `{d.name}` is needed to count FLOPs; pass sizes={{'{d.name}': ...}}")
        dims.append(Dim(d.name, size))
    return t.with_dims(dims)


def op_flops(op: Op, graph: Graph, sizes: dict, axes=()) -> float:
    """Forward FLOPs of one op (its region once per layer), dynamic dims taken from `sizes`."""
    if op.region is not None:  # each region as many times as it runs (`OpDef.runs`: a loop at its cap)
        runs, runs_second = get_op(op.name).runs(op.attrs)
        inner = list(axes) + op.stacking
        total = runs * sum(op_flops(o, graph, sizes, inner) for o in op.region.ops)
        if op.second is not None and runs_second:
            total += runs_second * sum(op_flops(o, graph, sizes, list(axes)) for o in op.second.ops)
        return total
    opdef = get_op(op.name)
    data, _ = split_operands(op, opdef)
    ins = [_concrete(param_type(graph, o.path, list(axes)) if isinstance(o, ParamRef) else o.type, sizes)
           for o in data]
    outs = [_concrete(r.type, sizes) for r in op.results]
    return float(opdef.flops(ins, outs, op.attrs))


def graph_flops(graph: Graph, sizes: dict) -> float:
    """Forward FLOPs of the whole graph for the given dynamic sizes, e.g. {"batch": 1, "seq": 4096}."""
    return sum(op_flops(op, graph, sizes) for op in graph.body.ops)
