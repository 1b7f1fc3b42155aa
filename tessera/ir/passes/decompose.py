"""decompose: composite ops → primitives, by each op's `OpDef.decompose` rule (tessera/ir/ops_nn.py).

Each rule gets a Builder, the op's data operands and its params by local name (`q`, `experts/gate`, ...)
and returns the values that replace the op's results. `fuse` turns these patterns back into fused ops.
"""

from __future__ import annotations

from tessera.ir.passes import register_pass
from tessera.ir.passes.rewrite import Builder, dce, regions, replace_uses
from tessera.ir.registry import get_op
from tessera.ir.types import Graph, Op
from tessera.ir.verify import split_operands


def local_params(op: Op, decls) -> dict:
    """The op's param operands by the names their decls give (`q`, `experts/gate`)."""
    _, owned = split_operands(op, get_op(op.name))
    return {d.name: ref for d, ref in zip(decls, owned)}


def decompose(graph: Graph, ctx) -> Graph:
    """Replace every op that has a decomposition with its primitives."""
    mapping = {}
    for region, axes in regions(graph):
        new_ops = []
        for op in region.ops:
            opdef = get_op(op.name)
            if opdef.decompose is None:
                new_ops.append(op)
                continue
            b = Builder(graph, axes, op.span)
            data, _ = split_operands(op, opdef)
            decls = opdef.params(op.attrs, [b.type_of(o) for o in data])
            outs = opdef.decompose(b, op, data, local_params(op, decls))
            new_ops += b.ops
            mapping.update((r.id, o) for r, o in zip(op.results, outs))
        region.ops = new_ops
    replace_uses(graph, mapping)
    return dce(graph)


register_pass("decompose", decompose)
