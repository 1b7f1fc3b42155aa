"""The verifier: every structural and typing invariant of a graph, separate from the passes.

Messages name the op as printed (`%5 = dot`), the operand, what was expected and what was got. All
problems found are reported together as one TesseraError.
"""

from __future__ import annotations

from tessera.diagnostics import Diagnostic, TesseraError, did_you_mean
from tessera.ir.registry import OPS, OpDef, OpError, _no_params, check_attrs, get_op
from tessera.ir.types import Graph, Op, ParamRef, PerLayer, Region, TensorType


def owns_params(opdef: OpDef) -> bool:
    """Whether the op declares parameters (then its value operands are exactly arity[1])."""
    return opdef.params is not _no_params


def split_operands(op: Op, opdef: OpDef) -> tuple[list, list[ParamRef]]:
    """(data operands, owned param refs) of an op."""
    if not owns_params(opdef):
        return list(op.operands), []
    n = opdef.arity[1]
    return list(op.operands[:n]), list(op.operands[n:])


def param_type(graph: Graph, path: str, axes: list[tuple[str, int]]) -> TensorType:
    """The type of `@path` seen inside regions stacking `axes` (their leading dims dropped); raise OpError."""
    p = graph.params.get(path)
    if p is None:
        hint = did_you_mean(path, graph.params)
        raise OpError(f"param `@{path}` is not declared" + (f"; {hint}" if hint else ""))
    t = p.type
    for name, n in axes:
        if not t.dims or t.dims[0].name != name or t.dims[0].size != n:
            raise OpError(f"param `@{path}` : {p.type} is read inside a repeat, so it needs a leading "
                          f"`{name}={n}` dim")
        t = t.with_dims(t.dims[1:])
    return t


class _Verifier:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.problems: list[Diagnostic] = []
        self.counter = 0
        self.param_depth: dict[str, int] = {}

    def report(self, op: Op | None, label: str, message: str) -> None:
        prefix = f"{label}: " if label else ""
        span = op.span if op else None
        line = None
        if span is not None and self.graph.source is not None:
            lines = self.graph.source.splitlines()
            line = lines[span.line - 1] if 0 < span.line <= len(lines) else None
        self.problems.append(Diagnostic(prefix + message, span=span, source_line=line))

    def operand_type(self, o, defined: set[int], axes) -> TensorType:
        if isinstance(o, ParamRef):
            depth = self.param_depth.setdefault(o.path, len(axes))
            if depth != len(axes):
                raise OpError(f"param `@{o.path}` is read both inside and outside a repeat")
            return param_type(self.graph, o.path, axes)
        if o.id not in defined:
            raise OpError(f"operand {o!r} is used before it is defined")
        return o.type

    def region(self, region: Region, defined: set[int], axes: list[tuple[str, int]]) -> None:
        defined = set(defined) | {a.id for a in region.args}
        for op in region.ops:
            self.op(op, defined, axes)
            defined |= {r.id for r in op.results}
        for v in region.outputs:
            if v.id not in defined:
                self.report(None, "", f"output {v!r} is not defined")

    def op(self, op: Op, defined: set[int], axes) -> None:
        names = []
        for _ in op.results:  # numbered as printed: results, then the region's ops
            names.append(f"%{self.counter}")
            self.counter += 1
        label = f"{', '.join(names)} = {op.name}" if names else op.name
        if op.region is not None:
            self.region_op(op, label, defined, axes)
        opdef = get_op(op.name)
        if opdef is None:
            hint = did_you_mean(op.name, OPS)
            self.report(op, label, f"unknown op `{op.name}`" + (f"; {hint}" if hint else ""))
            return
        try:
            self.check(op, opdef, defined, axes)
        except OpError as exc:
            self.report(op, label, str(exc))

    def check(self, op: Op, opdef: OpDef, defined: set[int], axes) -> None:
        data, owned = split_operands(op, opdef)
        lo, hi = opdef.arity
        if not lo <= len(data) <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            raise OpError(f"takes {want} operand(s), got {len(data)}")
        types = [self.operand_type(o, defined, axes) for o in data]
        attrs = check_attrs(opdef, op.attrs)
        if list(attrs) != list(op.attrs):
            missing = [a for a in attrs if a not in op.attrs]
            raise OpError(f"attributes must be written in full and in order: {', '.join(attrs)}"
                          + (f" (missing {', '.join(missing)})" if missing else ""))
        for name, value in attrs.items():
            if isinstance(value, PerLayer) and (not axes or len(value.values) != axes[-1][1]):
                n = axes[-1][1] if axes else 0
                raise OpError(f"attribute `{name}` has {len(value.values)} per-layer entries; "
                              + (f"the enclosing repeat has {n} layers" if axes else "it is not inside a repeat"))
        expected = opdef.region_rule(types, attrs, op) if opdef.region_rule else opdef.type_rule(types, attrs)
        if len(expected) != len(op.results):
            raise OpError(f"has {len(op.results)} result(s), expected {len(expected)}")
        for k, (got, want) in enumerate(zip(op.results, expected)):
            if (got.type.dtype, got.type.dims) != (want.dtype, want.dims):
                raise OpError(f"result {k} has type {got.type}, but the operand types give {want}")
        self.check_params(op, opdef, attrs, types, owned, defined, axes)

    def check_params(self, op, opdef, attrs, types, owned, defined, axes) -> None:
        decls = opdef.params(attrs, types)
        if len(decls) != len(owned):
            raise OpError(f"owns {len(decls)} param(s) ({', '.join(d.name for d in decls)}), "
                          f"got {len(owned)}")
        scopes = set()
        for decl, ref in zip(decls, owned):
            if not isinstance(ref, ParamRef):
                raise OpError(f"operand for param `{decl.name}` must be a param, got a value")
            if decl.absolute:
                ok = ref.path == decl.name
            else:
                ok = ref.path.endswith("/" + decl.name)
                scopes.add(ref.path[: -len(decl.name) - 1])
            if not ok:
                raise OpError(f"param operand `@{ref.path}` should be named `.../{decl.name}`")
            got = self.operand_type(ref, defined, axes)
            if got.dims != decl.dims:
                raise OpError(f"param `@{ref.path}` has dims [{', '.join(map(str, got.dims))}], "
                              f"expected [{', '.join(map(str, decl.dims))}]")
        if len(scopes) > 1:
            raise OpError(f"params of one op must share one scope, got {', '.join(sorted(scopes))}")

    def region_op(self, op: Op, label: str, defined: set[int], axes) -> None:
        if op.name != "repeat":  # loops and derivatives: closed regions (only their arguments), no stacking axis
            if op.attrs.get("n") is not None:
                self.report(op, label, "only `repeat` stacks its region's parameters")
            self.region(op.region, set(), axes)
            if op.second is not None:
                self.region(op.second, set(), axes)
            return
        n = op.attrs.get("n")
        axis = op.attrs.get("axis")
        carried = op.values
        args = op.region.args
        try:
            if not isinstance(n, int):
                raise OpError("a repeat needs attribute `n`")
            if len(args) != len(carried) + 1 or args[0].type != TensorType("i32", ()):
                raise OpError("the region takes the layer index (i32[]) then one argument per operand")
            for k, (a, v, y) in enumerate(zip(args[1:], carried, op.region.outputs)):
                if a.type != v.type or y.type != v.type:
                    raise OpError(f"carried value {k} has type {v.type}, but the region takes {a.type} "
                                  f"and yields {y.type}")
            if len(op.region.outputs) != len(carried):
                raise OpError(f"the region yields {len(op.region.outputs)} value(s), expected {len(carried)}")
        except OpError as exc:
            self.report(op, label, str(exc))
        stacked = [] if axis is None else [(axis.name, n if isinstance(n, int) else 0)]  # none: weights shared
        self.region(op.region, defined, axes + stacked)

    def loss(self, loss) -> None:
        """A `loss` entry: a closed region (its own inputs only) yielding one float scalar per term."""
        self.region(loss.region, set(), [])
        outs = loss.region.outputs
        if len(outs) != len(loss.terms):
            self.problems.append(Diagnostic(f"loss `{loss.name}` names {len(loss.terms)} term(s) "
                                            f"({', '.join(loss.terms)}) but yields {len(outs)} value(s)"))
        for term, v in zip(loss.terms, outs):
            if v.type.dims or not v.type.dtype.startswith(("f", "bf")):
                self.problems.append(Diagnostic(f"loss term `{term}` of `{loss.name}` must be a float scalar, "
                                                f"got {v.type}; reduce it, e.g. mean(r * r, over = [points])"))

    def run(self) -> None:
        g = self.graph
        self.region(g.body, set(), [])
        seen: set[str] = set()
        for loss in g.losses:
            self.loss(loss)
            for term in loss.terms:
                if term in seen:
                    self.problems.append(Diagnostic(f"loss term `{term}` is named twice"))
                seen.add(term)
        for path in g.params:
            if path not in self.param_depth:
                self.problems.append(Diagnostic(f"param `@{path}` is declared but never used"))


def verify(graph: Graph) -> Graph:
    """Check every invariant of `graph`; raise TesseraError listing all problems; return the graph."""
    v = _Verifier(graph)
    v.run()
    if v.problems:
        raise TesseraError(v.problems)
    return graph
