"""The model language: what parses into which AST, and syntax errors with exact positions."""

import pytest

from tessera.diagnostics import TesseraError
from tessera.grammar import model_ast as A
from tessera.grammar.model import parse_model, parse_model_file

SRC = """\
# a comment
model m(d: int, eps: float = 1e-5, tied: bool = false) {
  block layer(x: [batch, seq, embed = d], i: index) {
    h = rmsnorm(x, eps = eps) as attn_norm   # trailing comment
    w = i % 2 == 0 and not tied ? 128 : none
    return x + h * 2 ** -1
  }
  forward(tokens: i32[batch, seq]) {
    x = embed(tokens, 16, d)
    v, k = top_k(x, 2, embed)
    return repeat(2, layer, x) as layers/stack
  }
}
"""


def test_model_header_blocks_and_forward():
    m = parse_model(SRC, "m.tsl")
    assert m.name == "m"
    assert [(p.name, p.ann.name if p.ann else None) for p in m.params] == [
        ("d", "int"), ("eps", "float"), ("tied", "bool")]
    assert m.params[1].default == A.Const(1e-5, m.params[1].default.span)
    assert list(m.blocks) == ["layer"]
    x, i = m.blocks["layer"].params
    assert [(d.name, d.size is not None) for d in x.ann.dims] == [("batch", False), ("seq", False), ("embed", True)]
    assert i.ann.name == "index"
    assert m.forward.params[0].ann.dtype == "i32"


def test_calls_scopes_and_positions():
    m = parse_model(SRC, "m.tsl")
    assign = m.blocks["layer"].body[0]
    call = assign.value
    assert (call.func, call.scope, [k.name for k in call.kwargs]) == ("rmsnorm", "attn_norm", ["eps"])
    assert (call.span.line, call.span.col) == (4, 9)
    ret = m.forward.body[-1]
    assert ret.values[0].scope == "layers/stack"
    assert m.forward.body[1].names == ("v", "k")


def test_precedence_of_operators_and_conditionals():
    m = parse_model(SRC, "m.tsl")
    cond = m.blocks["layer"].body[1].value
    assert isinstance(cond, A.Ternary) and cond.cond.op == "and"
    assert cond.cond.left.op == "==" and cond.cond.left.left.op == "%"
    assert isinstance(cond.cond.right, A.Unary) and cond.cond.right.op == "not"
    assert cond.other == A.Const(None, cond.other.span)
    ret = m.blocks["layer"].body[2].values[0]
    assert ret.op == "+" and ret.right.op == "*" and ret.right.right.op == "**"
    assert isinstance(ret.right.right.right, A.Unary)  # 2 ** -1


def _error(text: str) -> str:
    with pytest.raises(TesseraError) as info:
        parse_model(text, "bad.tsl")
    return info.value.render()


def test_syntax_error_points_at_the_token():
    text = "model m() {\n  forward(t: i32[batch]) {\n    x = embed(t, 10 16)\n    return x\n  }\n}\n"
    assert _error(text).splitlines() == [
        "bad.tsl:3:21: error: unexpected `16`; expected `)`, `**`, `,`, `?`, `and`, `or`",
        "        x = embed(t, 10 16)",
        "                        ^",
    ]


def test_unexpected_character_and_end_of_file():
    assert _error("model m() {\n  forward() { return $ }\n}\n").splitlines()[0] == \
        "bad.tsl:2:22: error: unexpected character `$`"
    assert _error("model m() {\n  forward(t: i32[b]) {\n    return t\n").splitlines()[0].startswith(
        "bad.tsl:3:12: error: unexpected end of file; expected `(`")
    assert _error("model m() {\n  forward() {\n    x = 3 +\n  }\n}").splitlines()[0] == \
        "bad.tsl:4:3: error: unexpected `}`; expected `(`, `-`, `[`, `false`, `none`, `true`"


def test_structure_errors():
    assert _error("model m() {\n  block b(x: [n]) { return x }\n}\n").splitlines()[0] == \
        "bad.tsl:1:1: error: model `m` has no `forward(...)` block"
    text = "model m() {\n  block b(x: [n]) { return x }\n  block b(x: [n]) { return x }\n  forward() { return 1 }\n}"
    assert _error(text).splitlines()[0] == "bad.tsl:3:3: error: block `b` is defined twice (first at line 2)"


def test_missing_file_is_a_diagnostic(tmp_path):
    with pytest.raises(TesseraError, match="cannot read model file"):
        parse_model_file(tmp_path / "nope.tsl")
