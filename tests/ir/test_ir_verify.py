"""Invalid IR: each case is parsed and verified and must give exactly the expected diagnostic."""

import pytest

from tessera.diagnostics import TesseraError
from tessera.ir import parse_graph, verify

HEAD = "graph g {\n  input %x : f32[batch, embed=8]\n"



def _loop(attrs: str, step: str, halt: str = "%2 = sum(%g) {over = [embed]} : f32[batch]") -> str:
    """A loop carrying %x: its body is `step` (defining %1), its halting predicate the last value `halt` defines."""
    last = halt.split("\n")[-1].split()[0]
    return (f"  %0 = loop(%x) {attrs} ^(%h : f32[batch, embed=8]) {{\n    {step}\n    yield %1\n"
            f"  }} until ^(%g : f32[batch, embed=8]) {{\n    {halt}\n    yield {last}\n  }} : f32[batch, embed=8]\n"
            "  return %0\n}")


CASES = {
    "contracted dims disagree": (
        "  input %w : f32[embed=4, mlp=2]\n  %0 = dot(%x, %w) {over = [embed]} : f32[batch, mlp=2]\n  return %0\n}",
        "t.ir:4:3: error: %0 = dot: dimension `embed` is 8 in one of the operands but 4 in the other"),
    "declared result type is wrong": (
        "  %0 = silu(%x) : f32[batch, embed=4]\n  return %0\n}",
        "t.ir:3:3: error: %0 = silu: result 0 has type f32[batch, embed=4], but the operand types give "
        "f32[batch, embed=8]"),
    "unknown op": (
        "  %0 = sigmoidd(%x) : f32[batch, embed=8]\n  return %0\n}",
        "t.ir:3:3: error: %0 = sigmoidd: unknown op `sigmoidd`; did you mean `sigmoid`?"),
    "unknown dim": (
        "  %0 = softmax(%x) {dim = vocab} : f32[batch, embed=8]\n  return %0\n}",
        "t.ir:3:3: error: %0 = softmax: operand f32[batch, embed=8] has no dimension `vocab`"),
    "undeclared param": (
        "  %0 = rmsnorm(%x, @norm/scale) {eps = 1e-05, dim = embed} : f32[batch, embed=8]\n  return %0\n}",
        "t.ir:3:3: error: %0 = rmsnorm: param `@norm/scale` is not declared"),
    "param of the wrong shape": (
        "  param @norm/scale : f32[embed=4] = ones\n"
        "  %0 = rmsnorm(%x, @norm/scale) {eps = 1e-05, dim = embed} : f32[batch, embed=8]\n  return %0\n}",
        "t.ir:4:3: error: %0 = rmsnorm: param `@norm/scale` has dims [embed=4], expected [embed=8]"),
    "missing attribute": (
        "  %0 = softmax(%x) : f32[batch, embed=8]\n  return %0\n}",
        "t.ir:3:3: error: %0 = softmax: `softmax` needs attribute `dim`"),
    "attribute of the wrong kind": (
        "  %0, %1 = top_k(%x) {k = 2.5, dim = embed} : f32[batch, top_k=2], i32[batch, top_k=2]\n  return %0\n}",
        "t.ir:3:3: error: %0, %1 = top_k: attribute `k` of `top_k`: expected an integer, got 2.5"),
    "per-layer attribute outside a repeat": (
        "  %0 = gelu(%x) {approximate = per_layer[true, false]} : f32[batch, embed=8]\n  return %0\n}",
        "t.ir:3:3: error: %0 = gelu: attribute `approximate` of `gelu` cannot differ per layer"),
    "param read in a repeat is not stacked": (
        "  param @norm/scale : f32[embed=8] = ones\n"
        "  %0 = repeat(%x) {n = 2, axis = layers, grad = \"all\"} ^(%i : i32[], %h : f32[batch, embed=8]) {\n"
        "    %1 = rmsnorm(%h, @norm/scale) {eps = 1e-05, dim = embed} : f32[batch, embed=8]\n    yield %1\n"
        "  } : f32[batch, embed=8]\n  return %0\n}",
        "t.ir:5:5: error: %1 = rmsnorm: param `@norm/scale` : f32[embed=8] is read inside a repeat, so it needs "
        "a leading `layers=2` dim"),
    "repeat yields another type": (
        "  %0 = repeat(%x) {n = 2, axis = layers, grad = \"all\"} ^(%i : i32[], %h : f32[batch, embed=8]) {\n"
        "    %1 = sum(%h) {over = [embed]} : f32[batch]\n    yield %1\n  } : f32[batch, embed=8]\n  return %0\n}",
        "t.ir:3:3: error: %0 = repeat: carried value 0 has type f32[batch, embed=8], but the region takes "
        "f32[batch, embed=8] and yields f32[batch]"),
    "loop without a cap": (
        _loop("{grad = \"all\"}", "%1 = tanh(%h) : f32[batch, embed=8]"),
        "t.ir:3:3: error: %0 = loop: `loop` needs attribute `max`"),
    "loop state changes type": (
        _loop("{max = 4, grad = \"all\"}", "%1 = sum(%h) {over = [embed]} : f32[batch]"),
        "t.ir:3:3: error: %0 = loop: carried value 0 is f32[batch, embed=8] but the body yields f32[batch]: a "
        "loop's state keeps its shape and element type from one iteration to the next"),
    "halting predicate on a dim the state lacks": (
        _loop("{max = 4, grad = \"all\"}", "%1 = tanh(%h) : f32[batch, embed=8]",
              "%2 = sum(%g) {over = [batch]} : f32[embed=8]\n    %3 = rename(%2) {from = embed, to = cells} : "
              "f32[cells=8]"),
        "t.ir:3:3: error: %0 = loop: the halting predicate f32[cells=8] has dim `cells=8`, but carried value 0 is "
        "f32[batch, embed=8]: every carried value needs the predicate's dims (each entry halts the state it indexes)"),
    "unused param": (
        "  param @norm/scale : f32[embed=8] = ones\n  return %x\n}",
        "error: param `@norm/scale` is declared but never used"),
    "heads not a multiple of kv_heads": (
        "  input %q : f32[batch, seq, heads=3, head_dim=4]\n  input %k : f32[batch, seq, kv_heads=2, head_dim=4]\n"
        "  %0 = sdpa(%q, %k, %k) {causal = true, window = none, scale = 0.5, sinks = false} : "
        "f32[batch, seq, heads=3, head_dim=4]\n  return %0\n}",
        "t.ir:5:3: error: %0 = sdpa: heads (3) must be a multiple of kv_heads (2)"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_invalid_ir(name):
    body, expected = CASES[name]
    with pytest.raises(TesseraError) as info:
        verify(parse_graph(HEAD + body, "t.ir"))
    assert [d.render().splitlines()[0] for d in info.value.diagnostics] == [expected]


def test_diagnostics_show_the_ir_line():
    with pytest.raises(TesseraError) as info:
        verify(parse_graph(HEAD + CASES["unknown dim"][0], "t.ir"))
    assert info.value.render().splitlines()[1:] == [
        "      %0 = softmax(%x) {dim = vocab} : f32[batch, embed=8]",
        "      ^~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~",
    ]


@pytest.mark.parametrize("text, expected", [
    (HEAD + "  %0 = silu(%x) f32[batch, embed=8]\n  return %0\n}",
     "t.ir:3:17: error: unexpected `f32`; expected one of `:`, `^`, `{`"),
    (HEAD + "  %0 = silu(%y) : f32[batch, embed=8]\n  return %0\n}",
     "t.ir:3:3: error: value `%y` is used before it is defined"),
    (HEAD + "  %x = silu(%x) : f32[batch, embed=8]\n  return %x\n}",
     "t.ir:3:3: error: value `%x` is defined twice"),
    (HEAD + _loop("{max = 4, grad = \"all\"}", "%1 = tanh(%h) : f32[batch, embed=8]").replace("until", "adjoint"),
     "t.ir:6:5: error: the second region of `loop` is written `until ^(...)`, got `adjoint`"),
    (HEAD + "  %0 = silu(%x) ^(%h : f32[batch, embed=8]) {\n    yield %h\n  } until ^(%g : f32[batch, embed=8]) {\n"
     "    yield %g\n  } : f32[batch, embed=8]\n  return %0\n}",
     "t.ir:5:5: error: `silu` has no second region"),
])
def test_ir_syntax_errors(text, expected):
    with pytest.raises(TesseraError) as info:
        parse_graph(text, "t.ir")
    assert info.value.render().splitlines()[0] == expected


def test_all_problems_are_reported_together():
    text = HEAD + "  %0 = silu(%x) : f32[batch, embed=4]\n  %1 = sigmoidd(%x) : f32[batch, embed=8]\n  return %1\n}"
    with pytest.raises(TesseraError) as info:
        verify(parse_graph(text, "t.ir"))
    assert len(info.value.diagnostics) == 2
