"""Parse model-language source (.tsl) into the typed AST of model_ast.py, with positions.

Syntax errors become TesseraErrors `FILE:LINE:COL: error: …` with the source line and a caret.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import lark
from lark import v_args

from tessera.diagnostics import Diagnostic, Span, TesseraError, relpath
from tessera.grammar import model_ast as A

_GRAMMAR = Path(__file__).with_name("model.lark")
_TOKEN_WORDS = {"NAME": "a name", "INT": "an integer", "FLOAT": "a number", "LPAR": "`(`", "RPAR": "`)`",
                "LBRACE": "`{`", "RBRACE": "`}`", "LSQB": "`[`", "RSQB": "`]`", "COMMA": "`,`",
                "EQUAL": "`=`", "COLON": "`:`", "$END": "end of file", "MINUS": "`-`",
                "ESCAPED_STRING": "a string", "QMARK": "`?`", "SLASH": "`/`", "ADDOP": "an operator",
                "MULOP": "an operator", "COMPOP": "a comparison", "POW": "`**`", "__ANON_0": "`->`"}


@functools.lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    # cache=True: Lark's grammar analysis kept in a file under the system temp dir, keyed by the grammar's hash
    return lark.Lark(_GRAMMAR.read_text(), parser="lalr", propagate_positions=True, maybe_placeholders=True,
                     cache=True)


@v_args(meta=True, inline=False)
class _ToAst(lark.Transformer):
    """Parse tree → AST; `self.file` goes into every span."""

    def __init__(self, file: str, text: str):
        super().__init__()
        self.file, self.text = file, text

    def _span(self, meta) -> Span:
        end = meta.end_column if getattr(meta, "end_line", None) == meta.line else None
        return Span(self.file, meta.line, meta.column, end)

    def _tok_span(self, tok) -> Span:
        return Span(self.file, tok.line, tok.column, tok.end_column)

    # ---- expressions
    def name(self, meta, c):
        return A.Name(str(c[0]), self._tok_span(c[0]))

    def int_(self, meta, c):
        return A.Const(int(c[0]), self._tok_span(c[0]))

    def float_(self, meta, c):
        return A.Const(float(c[0]), self._tok_span(c[0]))

    def string(self, meta, c):
        return A.Const(json.loads(c[0]), self._tok_span(c[0]))

    def none(self, meta, c):
        return A.Const(None, self._span(meta))

    def true(self, meta, c):
        return A.Const(True, self._span(meta))

    def false(self, meta, c):
        return A.Const(False, self._span(meta))

    def list_(self, meta, c):
        return A.ListExpr(tuple(x for x in c if x is not None), self._span(meta))

    def sized(self, meta, c):
        return A.Sized(str(c[0]), c[1], self._span(meta))

    def kwarg(self, meta, c):
        return A.Kwarg(str(c[0]), c[1], self._span(meta))

    def path(self, meta, c):
        return "/".join(str(t) for t in c)

    def call(self, meta, c):
        func, scope, args = str(c[0]), c[-1], [x for x in c[1:-1] if x is not None]
        positional = tuple(a for a in args if not isinstance(a, A.Kwarg))
        kwargs = tuple(a for a in args if isinstance(a, A.Kwarg))
        return A.Call(func, positional, kwargs, scope, self._span(meta))

    def binop(self, meta, c):
        return A.BinOp(str(c[1]), c[0], c[2], self._span(meta))

    compare = binop

    def and_(self, meta, c):
        return A.BinOp("and", c[0], c[1], self._span(meta))

    def or_(self, meta, c):
        return A.BinOp("or", c[0], c[1], self._span(meta))

    def pow(self, meta, c):
        return A.BinOp("**", c[0], c[2], self._span(meta))

    def neg(self, meta, c):
        return A.Unary("neg", c[0], self._span(meta))

    def not_(self, meta, c):
        return A.Unary("not", c[0], self._span(meta))

    def ternary(self, meta, c):
        return A.Ternary(c[0], c[1], c[2], self._span(meta))

    # ---- declarations
    def dimdecl(self, meta, c):
        return A.DimDecl(str(c[0]), c[1], self._span(meta))

    def tensor_type(self, meta, c):
        dtype = None if c[0] is None else str(c[0])
        return A.TensorAnn(dtype, tuple(d for d in c[1:] if d is not None), self._span(meta))

    def scalar_type(self, meta, c):
        return A.ScalarAnn(str(c[0]), self._span(meta))

    def mparam(self, meta, c):
        ann = None if c[1] is None else A.ScalarAnn(str(c[1]), self._tok_span(c[1]))
        return A.Param(str(c[0]), ann, c[2], self._span(meta))

    def bparam(self, meta, c):
        return A.Param(str(c[0]), c[1], None, self._span(meta))

    def assign(self, meta, c):
        return A.Assign(tuple(str(t) for t in c[:-1]), c[-1], self._span(meta))

    def ret(self, meta, c):
        return A.Return(tuple(c), self._span(meta))

    def body(self, meta, c):
        return tuple(c)

    def block(self, meta, c):
        params = tuple(p for p in c[1:-2] if p is not None)
        return A.Block(str(c[0]), params, c[-2], self._span(meta), adjoint=c[-1])

    def adjoint(self, meta, c):
        return A.Adjoint(tuple(str(t) for t in c[:-1] if t is not None), c[-1], self._span(meta))

    def loss(self, meta, c):
        name, rest = str(c[0]), [x for x in c[1:-1] if x is not None]
        params = tuple(x for x in rest if isinstance(x, A.Param))
        terms = tuple(str(x) for x in rest if not isinstance(x, A.Param)) or (name,)
        return A.Block(name, params, c[-1], self._span(meta), terms=terms)

    def forward(self, meta, c):
        return A.Block("forward", tuple(p for p in c[:-1] if p is not None), c[-1], self._span(meta))

    def model(self, meta, c):
        name, rest = str(c[0]), [x for x in c[1:] if x is not None]
        params = tuple(x for x in rest if isinstance(x, A.Param))
        blocks: dict[str, A.Block] = {}
        losses: dict[str, A.Block] = {}
        forward = None
        for b in (x for x in rest if isinstance(x, A.Block)):
            if b.terms:
                if b.name in losses:
                    raise _fail(f"loss `{b.name}` is defined twice (first at line {losses[b.name].span.line})", b.span)
                losses[b.name] = b
            elif b.name == "forward":
                if forward is not None:
                    raise _fail("a model has one `forward`", b.span)
                forward = b
            elif b.name in blocks:
                raise _fail(f"block `{b.name}` is defined twice (first at line {blocks[b.name].span.line})", b.span)
            else:
                blocks[b.name] = b
        span = self._span(meta)
        if forward is None:
            raise _fail(f"model `{name}` has no `forward(...)` block", span)
        return A.Model(name, params, blocks, forward, span, self.file, self.text, losses)

    def start(self, meta, c):
        return c[0]


def _fail(message: str, span: Span) -> TesseraError:
    return TesseraError(Diagnostic(message, span=span))


class _Wrapped(Exception):
    pass


def _syntax_error(exc: lark.UnexpectedInput, file: str, text: str) -> TesseraError:
    lines = text.splitlines()
    line = lines[exc.line - 1] if 0 < exc.line <= len(lines) else ""
    if isinstance(exc, lark.UnexpectedCharacters):
        what = f"unexpected character `{line[exc.column - 1:exc.column]}`"
    else:
        tok = getattr(exc, "token", None)
        what = "unexpected end of file" if tok is None or tok.type == "$END" else f"unexpected `{tok}`"
    expected = sorted({_TOKEN_WORDS.get(e, f"`{e.lower()}`" if e.isalpha() and e.isupper() else e)
                       for e in (getattr(exc, "accepts", None) or getattr(exc, "expected", None) or [])})
    hint = f"expected {', '.join(expected[:6])}" if expected else None
    return TesseraError(Diagnostic(what, span=Span(file, exc.line, exc.column), hint=hint, source_line=line))


def parse_model(text: str, file: str = "<model>") -> A.Model:
    """Parse model source into a Model AST; raise TesseraError on a syntax error."""
    try:
        tree = _parser().parse(text)
    except lark.UnexpectedInput as exc:
        raise _syntax_error(exc, file, text) from None
    try:
        return _ToAst(file, text).transform(tree)
    except lark.exceptions.VisitError as exc:
        if isinstance(exc.orig_exc, TesseraError):
            raise exc.orig_exc from None
        raise


def parse_model_file(path: str | Path) -> A.Model:
    """Read and parse a .tsl file; a missing file is a TesseraError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TesseraError(Diagnostic(f"cannot read model file: {exc.strerror}", span=None)) from None
    return parse_model(text, relpath(path))
