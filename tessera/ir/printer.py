"""The IR text form. `print_graph` is canonical: values are numbered in print order, so two graphs
are equal exactly when their texts are. Example:

    graph llama {
      input %tokens : i32[batch, seq]
      param @embed/table : f32[vocab=256, embed=64] = normal(0.02)
      %0 = embed(%tokens, @embed/table) {vocab = 256, dim = 64, dtype = "f32"} : f32[batch, seq, embed=64]
      %1 = repeat(%0) {n = 2, axis = layers, grad = "all"} ^(%i : i32[], %x : f32[batch, seq, embed=64]) {
        ...
        yield %7
      } : f32[batch, seq, embed=64]
      return %9
    }
"""

from __future__ import annotations

import json
import re
from typing import Any

from tessera.ir.types import Dim, DimName, Graph, Op, ParamRef, PerLayer, Region, Struct, Value

_HINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def format_attr(value: Any) -> str:
    """One attribute value in IR syntax."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, DimName):
        return value.name
    if isinstance(value, Dim):
        return str(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(format_attr(v) for v in value) + "]"
    if isinstance(value, Struct):
        return value.kind + "{" + ", ".join(f"{k} = {format_attr(v)}" for k, v in value.fields) + "}"
    if isinstance(value, PerLayer):
        return "per_layer[" + ", ".join(format_attr(v) for v in value.values) + "]"
    raise TypeError(f"cannot print attribute value {value!r}")


class _Namer:
    """Canonical value names: %hint for inputs and region args (made unique), %N for op results."""

    def __init__(self):
        self.names: dict[int, str] = {}
        self.used: set[str] = set()
        self.counter = 0

    def arg(self, v: Value) -> str:
        base = v.name if v.name and _HINT.match(v.name) else "arg"
        name, k = base, 1
        while name in self.used:
            name, k = f"{base}.{k}", k + 1
        return self._bind(v, name)

    def result(self, v: Value) -> str:
        self.counter += 1
        return self._bind(v, str(self.counter - 1))

    def _bind(self, v: Value, name: str) -> str:
        self.used.add(name)
        self.names[v.id] = "%" + name
        return "%" + name

    def ref(self, o) -> str:
        if isinstance(o, ParamRef):
            return "@" + o.path
        return self.names.get(o.id, f"%<undefined {o.id}>")


def _op_lines(op: Op, namer: _Namer, indent: str) -> list[str]:
    operands = ", ".join(namer.ref(o) for o in op.operands)
    attrs = " {" + ", ".join(f"{k} = {format_attr(v)}" for k, v in op.attrs.items()) + "}" if op.attrs else ""
    head = f"{op.name}({operands}){attrs}"
    tail = " : " + ", ".join(str(r.type) for r in op.results)
    if op.region is None:
        lhs = ", ".join(namer.result(r) for r in op.results)
        return [f"{indent}{lhs} = {head}{tail}" if lhs else f"{indent}{head}{tail}"]
    args = ", ".join(f"{namer.arg(a)} : {a.type}" for a in op.region.args)
    lines = []
    lhs = ", ".join(namer.result(r) for r in op.results)  # results are numbered before the region
    body = _region_lines(op.region, namer, indent + "  ", "yield")
    lines.append(f"{indent}{lhs} = {head} ^({args}) {{")
    lines += body
    if op.second is not None:  # custom_vjp's adjoint, a loop's `until`: after the first, under its keyword
        args = ", ".join(f"{namer.arg(a)} : {a.type}" for a in op.second.args)
        lines.append(f"{indent}}} {second_keyword(op.name) or 'region'} ^({args}) {{")
        lines += _region_lines(op.second, namer, indent + "  ", "yield")
    return lines + [f"{indent}}}{tail}"]


def second_keyword(op_name: str) -> str | None:
    """The keyword an op's second region is written under (`OpDef.second`): None for an op without one, `region`
    for an unknown op."""
    from tessera.ir.registry import get_op

    opdef = get_op(op_name)
    return "region" if opdef is None else opdef.second


def _region_lines(region: Region, namer: _Namer, indent: str, term: str) -> list[str]:
    lines = []
    for op in region.ops:
        lines += _op_lines(op, namer, indent)
    lines.append(f"{indent}{term} " + ", ".join(namer.ref(v) for v in region.outputs))
    return lines


def print_graph(graph: Graph) -> str:
    """The canonical text of a graph (ends with a newline)."""
    namer = _Namer()
    lines = [f"graph {graph.name} {{"]
    lines += [f"  attr {k} = {format_attr(v)}" for k, v in graph.attrs.items()]
    lines += [f"  input {namer.arg(v)} : {v.type}" for v in graph.inputs]
    lines += [f"  param @{p.path} : {p.type} = {p.init}" for p in graph.params.values()]
    lines += _region_lines(graph.body, namer, "  ", "return")
    for loss in graph.losses:  # loss entries: closed regions yielding one scalar per named term
        args = ", ".join(f"{namer.arg(a)} : {a.type}" for a in loss.region.args)
        lines.append(f"  loss {loss.name} -> [{', '.join(loss.terms)}] ^({args}) {{")
        lines += _region_lines(loss.region, namer, "    ", "yield")
        lines.append("  }")
    return "\n".join(lines) + "\n}\n"
