"""Parse the IR text form (see printer.py) back into a Graph. Syntax errors are TesseraErrors with spans.

The parser checks only syntax and that every value is defined before use; types and attributes are
checked by the verifier (`tessera.ir.verify`), so an invalid graph can be parsed and then diagnosed.
"""

from __future__ import annotations

import functools
import json

import lark

from tessera.diagnostics import Diagnostic, Span, TesseraError
from tessera.ir.printer import second_keyword
from tessera.ir.types import (Dim, DimName, Graph, Init, Objective, Op, Param, ParamRef, PerLayer, Region, Struct,
                              TensorType, Value)

GRAMMAR = r"""
start: "graph" NAME "{" gattr* ginput* gparam* op* ret gloss* "}"
gloss: "loss" NAME "->" "[" NAME ("," NAME)* "]" region
gattr: "attr" NAME "=" value
ginput: "input" VAR ":" type
gparam: "param" PARAM ":" type "=" init
init: NAME ["(" NUMBER ")"]
ret: "return" [VAR ("," VAR)*]

op: [VAR ("," VAR)* "="] NAME "(" [operand ("," operand)*] ")" [attrs] [region [second]] ":" type ("," type)*
second: NAME region
region: "^" "(" [rarg ("," rarg)*] ")" "{" op* yield_ "}"
rarg: VAR ":" type
yield_: "yield" [VAR ("," VAR)*]
?operand: VAR | PARAM
attrs: "{" [attr ("," attr)*] "}"
attr: NAME "=" value

?value: "none" -> none
      | "true" -> true
      | "false" -> false
      | NUMBER -> number
      | ESCAPED_STRING -> string
      | NAME -> dimname
      | NAME "=" INT -> sized_dim
      | "[" [values] "]" -> tuple
      | "per_layer" "[" [values] "]" -> per_layer
      | NAME "{" [attr ("," attr)*] "}" -> struct
values: value ("," value)*

type: NAME "[" [dim ("," dim)*] "]" [shard]
dim: NAME ["=" INT]
shard: "|" "[" SHARD ("," SHARD)* "]"
SHARD: /[A-Za-z_][A-Za-z0-9_]*(\*[A-Za-z_][A-Za-z0-9_]*)*|-/

VAR: /%[A-Za-z0-9_.]+/
PARAM: /@[A-Za-z0-9_\/.]+/
NAME: /[A-Za-z_][A-Za-z0-9_]*/
NUMBER: /-?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?/
INT: /\d+/
%import common.ESCAPED_STRING
%import common.WS
%ignore WS
COMMENT: "//" /[^\n]*/
%ignore COMMENT
"""

@functools.lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    """Built on first use, not at import (most processes never parse IR text); `cache=True` keeps Lark's grammar
    analysis in a file under the system temp dir (keyed by the grammar's hash and Lark's version): 0.18 s to
    build, 0.015 s to load."""
    return lark.Lark(GRAMMAR, parser="lalr", propagate_positions=True, maybe_placeholders=True, cache=True)


_TOKENS = {"CIRCUMFLEX": "`^`", "COLON": "`:`", "LBRACE": "`{`", "RBRACE": "`}`", "LPAR": "`(`", "RPAR": "`)`",
           "LSQB": "`[`", "RSQB": "`]`", "COMMA": "`,`", "EQUAL": "`=`", "VAR": "a %value", "PARAM": "a @param",
           "NAME": "a name", "NUMBER": "a number", "INT": "an integer", "VBAR": "`|`", "$END": "end of input"}


def _number(tok: str):
    return int(tok) if tok.lstrip("-").isdigit() else float(tok)


class _ToValue(lark.Transformer):
    """Attribute values and types (the parts that need no symbol table)."""

    none = lambda self, _: None  # noqa: E731
    true = lambda self, _: True  # noqa: E731
    false = lambda self, _: False  # noqa: E731

    def number(self, c):
        return _number(str(c[0]))

    def string(self, c):
        return json.loads(c[0])

    def dimname(self, c):
        return DimName(str(c[0]))

    def sized_dim(self, c):
        return Dim(str(c[0]), int(c[1]))

    def values(self, c):
        return list(c)

    def tuple(self, c):
        return tuple(c[0] or ())

    def per_layer(self, c):
        return PerLayer(tuple(c[0] or ()))

    def attr(self, c):
        return (str(c[0]), c[1])

    def struct(self, c):
        return Struct(str(c[0]), tuple(f for f in c[1:] if f is not None))

    def attrs(self, c):
        return dict(f for f in c if f is not None)

    def dim(self, c):
        return Dim(str(c[0]), None if c[1] is None else int(c[1]))

    def shard(self, c):
        return tuple(None if str(s) == "-" else str(s) for s in c)

    def type(self, c):
        dims = tuple(d for d in c[1:-1] if d is not None)
        return TensorType(str(c[0]), dims, c[-1])

    def init(self, c):
        return Init(str(c[0]), None if c[1] is None else float(c[1]))


class _Builder:
    """Walks the parse tree building values, ops and regions with lexical scoping."""

    def __init__(self, file: str, text: str):
        self.file, self.lines = file, text.splitlines()
        self.scopes: list[dict[str, Value]] = [{}]

    def span(self, meta) -> Span:
        return Span(self.file, meta.line, meta.column, meta.end_column if meta.end_line == meta.line else None)

    def fail(self, message: str, meta) -> TesseraError:
        span = self.span(meta)
        line = self.lines[span.line - 1] if 0 < span.line <= len(self.lines) else None
        return TesseraError(Diagnostic(message, span=span, source_line=line))

    def define(self, tok, type: TensorType, meta) -> Value:
        name = str(tok)[1:]
        if any(name in s for s in self.scopes):
            raise self.fail(f"value `%{name}` is defined twice", meta)
        v = Value(type, None if name[0].isdigit() else name.split(".")[0])
        self.scopes[-1][name] = v
        return v

    def use(self, tok, meta):
        if str(tok).startswith("@"):
            return ParamRef(str(tok)[1:])
        name = str(tok)[1:]
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise self.fail(f"value `%{name}` is used before it is defined", meta)

    def graph(self, tree) -> Graph:
        name, items = str(tree.children[0]), tree.children[1:]
        attrs, params, inputs = {}, {}, []
        ops, outputs, losses = [], [], []
        for item in items:
            kind = item.data
            if kind == "gattr":
                attrs[str(item.children[0])] = item.children[1]
            elif kind == "ginput":
                inputs.append(self.define(item.children[0], item.children[1], item.meta))
            elif kind == "gparam":
                path = str(item.children[0])[1:]
                if path in params:
                    raise self.fail(f"param `@{path}` is declared twice", item.meta)
                params[path] = Param(path, item.children[1], item.children[2])
            elif kind == "op":
                ops.append(self.op(item))
            elif kind == "gloss":
                names = [str(t) for t in item.children[:-1]]
                losses.append(Objective(names[0], tuple(names[1:]), self.region(item.children[-1])))
            else:  # ret
                outputs = [self.use(t, item.meta) for t in item.children if t is not None]
        return Graph(name, Region(inputs, ops, outputs), params, attrs, "\n".join(self.lines), losses)

    def op(self, tree) -> Op:
        c = tree.children
        i = 0
        lhs = []
        while i < len(c) and (c[i] is None or (isinstance(c[i], lark.Token) and c[i].type == "VAR")):
            if c[i] is not None:
                lhs.append(c[i])
            i += 1
        name = str(c[i])
        rest = c[i + 1:]
        operands = [self.use(t, tree.meta) for t in rest if isinstance(t, lark.Token)]
        attrs = next((t for t in rest if isinstance(t, dict)), None) or {}
        region_tree = next((t for t in rest if isinstance(t, lark.Tree) and t.data == "region"), None)
        second_tree = next((t for t in rest if isinstance(t, lark.Tree) and t.data == "second"), None)
        types = [t for t in rest if isinstance(t, TensorType)]
        region = self.region(region_tree) if region_tree is not None else None
        second = None
        if second_tree is not None:
            keyword, want = str(second_tree.children[0]), second_keyword(name)
            if keyword != want:
                raise self.fail(f"`{name}` has no second region" if want is None else
                                f"the second region of `{name}` is written `{want} ^(...)`, got `{keyword}`",
                                second_tree.meta)
            second = self.region(second_tree.children[1])
        if len(lhs) != len(types):
            raise self.fail(f"`{name}` names {len(lhs)} result(s) but gives {len(types)} type(s)", tree.meta)
        results = [self.define(tok, t, tree.meta) for tok, t in zip(lhs, types)]
        return Op(name, operands, attrs, results, region, self.span(tree.meta), second)

    def region(self, tree) -> Region:
        self.scopes.append({})
        args = [self.define(r.children[0], r.children[1], r.meta) for r in tree.children
                if isinstance(r, lark.Tree) and r.data == "rarg"]
        ops = [self.op(t) for t in tree.children if isinstance(t, lark.Tree) and t.data == "op"]
        y = next(t for t in tree.children if isinstance(t, lark.Tree) and t.data == "yield_")
        outputs = [self.use(t, y.meta) for t in y.children if t is not None]
        self.scopes.pop()
        return Region(args, ops, outputs)


def parse_graph(text: str, file: str = "<ir>") -> Graph:
    """Parse IR text into a Graph (syntax and scoping only; run `verify` for the rest)."""
    try:
        tree = _parser().parse(text)
    except lark.UnexpectedInput as exc:
        lines = text.splitlines()
        line = lines[exc.line - 1] if 0 < exc.line <= len(lines) else None
        token = getattr(exc, "token", None)
        what = f"unexpected `{token}`" if token else "unexpected input"
        expected = sorted({_TOKENS.get(e, e) for e in getattr(exc, "expected", None) or []})
        hint = f"expected one of {', '.join(expected[:8])}" if expected else None
        raise TesseraError(Diagnostic(what, span=Span(file, exc.line, exc.column), hint=hint,
                                      source_line=line)) from None
    tree = _ToValue(visit_tokens=False).transform(tree)
    return _Builder(file, text).graph(tree)
