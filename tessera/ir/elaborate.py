"""Elaboration: a parsed model + its arguments → a typed, verified Graph.

Compile-time values (ints, floats, bools, none, strings, structs) are evaluated here; tensor expressions
become ops. Inside `repeat(n, block, x)` the block is elaborated once into the repeat's region; the layer
index is a region argument, and compile-time arithmetic on it yields `PerLayer` tables (one entry per
layer), so per-layer differences stay data and the whole stack lowers to one scan.
"""

from __future__ import annotations

import dataclasses
import operator
from pathlib import Path
from typing import Any, Callable

from tessera.diagnostics import Diagnostic, Span, TesseraError, did_you_mean
from tessera.grammar import model_ast as A
from tessera.grammar.model import parse_model_file
from tessera.ir.types import Dim, Graph, Param, ParamRef, PerLayer, Region, TensorType, Value, canonical_dtype

ArgSpan = Callable[[str], "Span | None"]


@dataclasses.dataclass(frozen=True)
class PTensor:
    """A parameter used as a tensor in the source (`param(...)`): its ref and per-layer type."""

    ref: ParamRef
    type: TensorType


@dataclasses.dataclass(frozen=True)
class LayerIndex:
    """The layer index of a repeated block: a region argument, or a per-layer table in arithmetic."""

    value: Value
    n: int


Tensor = (Value, PTensor)

_ARITH = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
          "//": operator.floordiv, "%": operator.mod, "**": operator.pow, "==": operator.eq,
          "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
          "and": lambda a, b: a and b, "or": lambda a, b: a or b}
_TENSOR_OPS = {"+": "add", "-": "sub", "*": "mul", "/": "div"}


def _kind(value: Any) -> str:
    from tessera.ir.registry import describe_value

    if isinstance(value, Tensor):
        return f"a tensor {value.type}"
    return describe_value(value)


@dataclasses.dataclass
class _Frame:
    """Where ops go and how param paths are formed: the region, the scope prefix, the repeat axes."""

    region: Region
    prefix: tuple[str, ...]
    axes: tuple[tuple[str, int], ...]
    stack: tuple[str, ...]  # blocks being elaborated, for recursion errors
    root: tuple[str, ...] = ()  # the scope a block called by name (or differentiated) is named from: the innermost repeat's
    shares: bool = False  # in a loss or a derivative region: a param declared again the same way is the same param


class Elaborator:
    """Evaluates one model with concrete arguments into a Graph."""

    def __init__(self, model: A.Model, args: dict, *, dims: dict | None = None, arg_span: ArgSpan | None = None,
                 arg_key_span: ArgSpan | None = None):
        self.model = model
        self.lines = model.source.splitlines()
        self.dims = dict(dims or {})
        self.arg_span = arg_span or (lambda name: None)  # where an argument's value was written
        self.arg_key_span = arg_key_span or self.arg_span  # ... and its name: an unknown one is wrong there
        self.params: dict[str, Param] = {}
        self.shared: set[str] = set()  # params declared in a loss or a derivative region (others may read them)
        self.instances: dict[tuple[str, ...], str] = {}  # a by-name block call's scope -> the block (elab_calls)
        self.globals = self._bind_args(args)

    # ---- diagnostics
    def error(self, message: str, span: Span | None, notes: list[Diagnostic] = (), hint=None) -> TesseraError:
        line = self.lines[span.line - 1] if span and span.file == self.model.file and 0 < span.line <= len(
            self.lines) else None
        return TesseraError([Diagnostic(message, span=span, source_line=line, hint=hint), *notes])

    def arg_note(self, name: str) -> list[Diagnostic]:
        """A note pointing at where model argument `name` was set in the spec, when known."""
        span = self.arg_span(name)
        if span is None or name not in self.globals:
            return []
        from tessera.ir.registry import describe_value

        return [Diagnostic(f"`{name}` = {describe_value(self.globals[name])} is set here", span=span,
                           key=f"model.args.{name}", severity="note")]

    # ---- model arguments
    def _bind_args(self, args: dict) -> dict:
        declared = {p.name: p for p in self.model.params}
        for name in args:
            if name not in declared:
                raise self.error(f"model `{self.model.name}` has no argument `{name}`",
                                 self.arg_key_span(name) or self.model.span, hint=did_you_mean(name, declared))
        env: dict[str, Any] = {}
        for p in self.model.params:
            if p.name in args:
                value, span = args[p.name], self.arg_span(p.name) or p.span
            elif p.default is not None:
                value, span = self.eval(p.default, env), p.span
            else:
                raise self.error(f"model `{self.model.name}` needs argument `{p.name}`", p.span)
            env[p.name] = self._check_scalar(p, value, span)
        return env

    def _check_scalar(self, p: A.Param, value: Any, span: Span) -> Any:
        kind = p.ann.name if isinstance(p.ann, A.ScalarAnn) else None
        ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "bool": lambda v: isinstance(v, bool), None: lambda v: True}
        if kind not in ok:
            raise self.error(f"unknown argument type `{kind}` (use int, float or bool)", p.ann.span)
        if not ok[kind](value):
            raise self.error(f"argument `{p.name}` must be {'an' if kind == 'int' else 'a'} {kind}, "
                             f"got {_kind(value)}", span)
        return float(value) if kind == "float" else value

    # ---- entry
    def run(self) -> Graph:
        fwd = self.model.forward
        inputs, env = [], dict(self.globals)
        for p in fwd.params:
            if not isinstance(p.ann, A.TensorAnn):
                raise self.error(f"`forward` parameter `{p.name}` needs a tensor type like i32[batch, seq]", p.span)
            t = self._ann_type(p.ann, env, default_dtype="f32")
            v = Value(t, p.name)
            inputs.append(v)
            env[p.name] = v
        frame = _Frame(Region(inputs, [], []), (), (), ("forward",))
        outs = self.exec_body(fwd, env, frame)
        for o, e in zip(outs, self._return_exprs(fwd)):
            if not isinstance(o, Tensor):
                raise self.error(f"`forward` must return tensors, got {_kind(o)}", e.span)
        frame.region.outputs = [self.as_value(o, frame) for o in outs]
        losses = [self._loss(block) for block in self.model.losses.values()]
        return Graph(self.model.name, frame.region, self.params, losses=losses)

    def _loss(self, block: A.Block):
        """A `loss` entry as an Objective: its inputs, its body, one float scalar per named term."""
        from tessera.ir.types import Objective

        env, args = dict(self.globals), []
        for p in block.params:
            if not isinstance(p.ann, A.TensorAnn):
                raise self.error(f"`loss {block.name}` parameter `{p.name}` needs a tensor type like "
                                 f"f32[points, coord = 2]", p.span)
            v = Value(self._ann_type(p.ann, env, default_dtype="f32"), p.name)
            args.append(v)
            env[p.name] = v
        frame = _Frame(Region(args, [], []), (), (), (f"loss {block.name}",), shares=True)
        outs = self.exec_body(block, env, frame)
        exprs = self._return_exprs(block)
        if len(outs) != len(block.terms):
            raise self.error(f"`loss {block.name}` names {len(block.terms)} term(s) ({', '.join(block.terms)}) "
                             f"but returns {len(outs)} value(s)", exprs[0].span if exprs else block.span)
        for o, e, term in zip(outs, exprs, block.terms):
            if not isinstance(o, Tensor) or o.type.dims:
                raise self.error(f"loss term `{term}` must be a scalar, got {_kind(o)}", e.span,
                                 hint="reduce it, e.g. mean(r * r, over = [points])")
        frame.region.outputs = [self.as_value(o, frame) for o in outs]
        return Objective(block.name, block.terms, frame.region, block.span)

    def _return_exprs(self, block: A.Block) -> tuple:
        ret = next((s for s in block.body if isinstance(s, A.Return)), None)
        return ret.values if ret else ()

    def _ann_type(self, ann: A.TensorAnn, env: dict, default_dtype: str) -> TensorType:
        dims, seen = [], set()
        for d in ann.dims:
            if d.name in seen:
                raise self.error(f"dimension `{d.name}` appears twice", d.span)
            seen.add(d.name)
            size = self.size(d.size, env, d.name) if d.size is not None else self.dims.get(d.name)
            dims.append(Dim(d.name, size))
        return TensorType(canonical_dtype(ann.dtype or default_dtype), tuple(dims))

    def size(self, expr: A.Expr, env: dict, what: str) -> int:
        """A compile-time dimension size: a positive integer."""
        v = self.eval(expr, env)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise self.error(f"the size of `{what}` must be a positive integer, got {_kind(v)}", expr.span)
        return v

    # ---- statements
    def exec_body(self, block: A.Block, env: dict, frame: _Frame) -> list:
        for stmt in block.body:
            if isinstance(stmt, A.Return):
                return [self.eval(e, env, frame) for e in stmt.values]
            value = self.eval(stmt.value, env, frame)
            if len(stmt.names) == 1:
                env[stmt.names[0]] = value
                continue
            if not isinstance(value, tuple) or len(value) != len(stmt.names):
                n = len(value) if isinstance(value, tuple) else 1
                raise self.error(f"{len(stmt.names)} names but the right side gives {n} value(s)", stmt.span)
            env.update(zip(stmt.names, value))
        raise self.error(f"block `{block.name}` has no `return`", block.span)

    # ---- expressions
    def eval(self, e: A.Expr, env: dict, frame: _Frame | None = None) -> Any:
        """The value of an expression: a compile-time value, a PerLayer table, or a tensor."""
        if isinstance(e, A.Const):
            return e.value
        if isinstance(e, A.Name):
            if e.id not in env:
                raise self.error(f"unknown name `{e.id}`", e.span, hint=did_you_mean(e.id, env))
            return env[e.id]
        if isinstance(e, A.ListExpr):
            return tuple(self.eval(x, env, frame) for x in e.items)
        if isinstance(e, A.Ternary):
            return self._ternary(e, env, frame)
        if isinstance(e, A.Unary):
            return self._unary(e, env, frame)
        if isinstance(e, A.BinOp):
            return self._binop(e, env, frame)
        if isinstance(e, A.Call):
            from tessera.ir.elab_calls import call

            return call(self, e, env, frame)
        raise self.error("a `name = size` item only makes sense in a shape like [heads = 8]", e.span)

    def _ternary(self, e: A.Ternary, env, frame):
        cond = self._per_layer(self.eval(e.cond, env, frame))
        if isinstance(cond, bool):  # only the chosen branch is elaborated
            return self.eval(e.then if cond else e.other, env, frame)
        if isinstance(cond, PerLayer):
            a, b = self.eval(e.then, env, frame), self.eval(e.other, env, frame)
            if isinstance(a, Tensor) or isinstance(b, Tensor):
                raise self.error("a condition that differs per layer can choose attribute values, not tensors",
                                 e.span)
            n = len(cond.values)
            a, b = (x.values if isinstance(x, PerLayer) else (x,) * n for x in (a, b))
            return PerLayer(tuple(x if c else y for c, x, y in zip(cond.values, a, b)))
        raise self.error(f"a condition must be true or false, got {_kind(cond)}", e.cond.span)

    def _unary(self, e: A.Unary, env, frame):
        v = self._per_layer(self.eval(e.operand, env, frame))
        if isinstance(v, Tensor) and e.op == "neg":
            return self.emit(frame, "neg", [v], {}, e.span)[0]
        fn = operator.neg if e.op == "neg" else operator.not_
        return self._lift(fn, e, v)

    def _binop(self, e: A.BinOp, env, frame):
        a = self._per_layer(self.eval(e.left, env, frame))
        b = self._per_layer(self.eval(e.right, env, frame))
        ta, tb = isinstance(a, Tensor), isinstance(b, Tensor)
        if ta and tb and e.op in _TENSOR_OPS:
            return self.emit(frame, _TENSOR_OPS[e.op], [a, b], {}, e.span)[0]
        if (ta or tb) and e.op in ("*", "/"):  # tensor × constant (maybe per layer) → scale
            t, c = (a, b) if ta else (b, a)
            number = all(isinstance(v, (int, float)) and not isinstance(v, bool)
                         for v in (c.values if isinstance(c, PerLayer) else (c,)))
            if number and (ta or e.op == "*"):
                by = c if e.op == "*" else self._lift(lambda v: 1.0 / v, e, c)
                return self.emit(frame, "scale", [t], {"by": by}, e.span)[0]
        if ta or tb:
            raise self.error(f"`{e.op}` cannot combine {_kind(a)} and {_kind(b)}", e.span)
        return self._lift(_ARITH[e.op], e, a, b)

    def _per_layer(self, v):
        return PerLayer(tuple(range(v.n))) if isinstance(v, LayerIndex) else v

    def _lift(self, fn, e, *vals):
        """Apply a compile-time operator, elementwise over PerLayer tables."""
        n = next((len(v.values) for v in vals if isinstance(v, PerLayer)), None)
        try:
            if n is None:
                return fn(*vals)
            cols = [v.values if isinstance(v, PerLayer) else (v,) * n for v in vals]
            return PerLayer(tuple(fn(*row) for row in zip(*cols)))
        except (TypeError, ZeroDivisionError, OverflowError) as exc:
            what = " and ".join(_kind(v) for v in vals)
            raise self.error(f"cannot compute `{getattr(e, 'op', '?')}` of {what}: {exc}", e.span) from None

    # ---- emitting ops
    def as_value(self, t, frame: _Frame):
        return t.ref if isinstance(t, PTensor) else t

    def emit(self, frame: _Frame, name: str, data: list, attrs: dict, span: Span, scope: str | None = None,
             arg_exprs: dict | None = None) -> list[Value]:
        from tessera.ir.elab_calls import emit_op

        return emit_op(self, frame, name, data, attrs, span, scope, arg_exprs or {})


def elaborate(model: A.Model, args: dict, *, dims: dict | None = None, arg_span: ArgSpan | None = None,
              arg_key_span: ArgSpan | None = None) -> Graph:
    """Elaborate a parsed model with `args` into a Graph (not yet verified)."""
    return Elaborator(model, args, dims=dims, arg_span=arg_span, arg_key_span=arg_key_span).run()


def bound_args(model_path: str | Path, args: dict, *, arg_span: ArgSpan | None = None) -> dict:
    """A .tsl model's full arguments: `args` checked and laid over the file's declared defaults."""
    return Elaborator(parse_model_file(model_path), dict(args), arg_span=arg_span).globals


def build_graph(model_path: str | Path, args: dict, *, numerics=None, dims: dict | None = None,
                arg_span: ArgSpan | None = None, arg_key_span: ArgSpan | None = None) -> Graph:
    """Parse + elaborate + verify a .tsl model; with `numerics`, also apply the numeric policy."""
    from tessera.ir.verify import verify

    graph = verify(elaborate(parse_model_file(model_path), dict(args), dims=dims, arg_span=arg_span,
                             arg_key_span=arg_key_span))
    if numerics is not None:
        from tessera.ir.passes import PassContext, run_pass

        graph = run_pass("numerics", graph, PassContext(numerics=numerics))
    return graph


def check_experiment(exp) -> Graph:
    """Elaborate the experiment's model and check it against the spec (mesh, numeric rules)."""
    from tessera.ir.check import check_experiment as _check

    return _check(exp)
