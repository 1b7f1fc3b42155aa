"""Semantic errors in model source: each gives one exact `FILE:LINE:COL: error: …` diagnostic."""

import pytest

from tessera.diagnostics import Span, TesseraError
from tessera.grammar.model import parse_model
from tessera.ir.elaborate import elaborate

HEAD = "model m(d: int = 64, h: int = 4, kv: int = 3) {\n"
FWD = "  forward(t: i32[batch, seq]) {\n    x = embed(t, 10, d)\n"


def _first_line(body: str, args=None, **kw) -> str:
    with pytest.raises(TesseraError) as info:
        elaborate(parse_model(HEAD + body, "m.tsl"), args or {}, **kw)
    return info.value.diagnostics[0].render().splitlines()[0]


# a block to loop over x (its state) and a halting block (a predicate per batch entry)
_LOOP = ("  block b(x: [batch, seq, embed]) {\n    return tanh(x)\n  }\n"
         "  block halt(x: [batch, seq, embed]) {\n    return sum(x, over = [embed, seq])\n  }\n")

CASES = {
    "unknown op": (FWD + "    return embedd(x)\n  }\n}",
                   "m.tsl:4:12: error: unknown op or block `embedd`; did you mean `embed`?"),
    "wrong argument": (FWD + "    return rmsnorm(x, epss = 1e-6)\n  }\n}",
                       "m.tsl:4:23: error: `rmsnorm` has no argument `epss`; did you mean `eps`?"),
    "argument given twice": (FWD + "    return rmsnorm(x, 1e-6, eps = 1e-6)\n  }\n}",
                             "m.tsl:4:29: error: argument `eps` of `rmsnorm` is given twice"),
    "unknown dimension": (FWD + "    return softmax(x, dim = vocab)\n  }\n}",
                          "m.tsl:4:12: error: `softmax`: operand f32[batch, seq, embed=64] has no dimension `vocab`"),
    "shape mismatch": (FWD + "    y = embed(t, 10, 32) as e2\n    return x + y\n  }\n}",
                       "m.tsl:5:12: error: `add`: dimension `embed` is 64 in one of the operands but 32 in the other"),
    "size that is not an integer": (
        "  forward(t: i32[batch, seq]) {\n    return embed(t, 10, d / 2)\n  }\n}",
        "m.tsl:3:25: error: argument `dim` of `embed`: expected an integer, got 32.0"),
    "annotated size that is not an integer": (
        "  forward(t: i32[batch = 2.5, seq]) {\n    return t\n  }\n}",
        "m.tsl:2:26: error: the size of `batch` must be a positive integer, got 2.5"),
    "recursion": ("  block b(x: [batch, seq, embed]) {\n    return b(x)\n  }\n" + FWD + "    return b(x)\n  }\n}",
                  "m.tsl:3:12: error: block `b` calls itself (forward → b → b)"),
    "repeat of itself": (
        "  block b(x: [batch, seq, embed]) {\n    return repeat(2, b, x)\n  }\n" + FWD
        + "    return repeat(2, b, x)\n  }\n}",
        "m.tsl:3:12: error: block `b` repeats itself (forward → b → b)"),
    "heads not a multiple of kv_heads": (
        FWD + "    return attention(x, heads = h, kv_heads = kv, head_dim = 16)\n  }\n}",
        "m.tsl:4:12: error: `attention`: heads (4) must be a multiple of kv_heads (3)"),
    "unknown name": ("  forward(t: i32[batch, seq]) {\n    return embed(t, 10, dd)\n  }\n}",
                     "m.tsl:3:25: error: unknown name `dd`; did you mean `d`?"),
    "block argument of another shape": (
        "  block b(x: [batch, seq, hidden]) {\n    return x\n  }\n" + FWD + "    return b(x)\n  }\n}",
        "m.tsl:7:14: error: argument `x` of block `b` has type f32[batch, seq, embed=64], but the block expects "
        "[batch, seq, hidden]"),
    "two ops declare one param": (
        FWD + "    x = rmsnorm(x)\n    return rmsnorm(x)\n  }\n}",
        "m.tsl:5:12: error: parameter `rmsnorm/scale` is declared twice (first at line 4); name one of the ops "
        "with `as`, e.g. rmsnorm(x) as attn_norm"),
    "per-layer choice of tensors": (
        "  block b(x: [batch, seq, embed], i: index) {\n    return i % 2 == 0 ? x : rmsnorm(x)\n  }\n" + FWD
        + "    return repeat(2, b, x)\n  }\n}",
        "m.tsl:3:12: error: a condition that differs per layer can choose attribute values, not tensors"),
    "per-layer attribute that cannot vary": (
        "  block b(x: [batch, seq, embed], i: index) {\n    return rmsnorm(x, eps = i * 0.1)\n  }\n" + FWD
        + "    return repeat(2, b, x)\n  }\n}",
        "m.tsl:3:29: error: argument `eps` of `rmsnorm`: cannot differ per layer"),
    "unknown struct field": (
        FWD + "    return attention(x, heads = 4, kv_heads = 2, head_dim = 16, rope = yarn(thetaa = 1))\n  }\n}",
        "m.tsl:4:72: error: `yarn` has no field `thetaa` (fields: theta, factor, original, beta_fast, beta_slow, "
        "truncate)"),
    "tensor where a number is needed": (
        FWD + "    return rmsnorm(x, eps = x)\n  }\n}",
        "m.tsl:4:29: error: expected a compile-time value, got a tensor f32[batch, seq, embed=64]"),
    "tied unembedding without a table": (
        "  forward(t: [batch, seq, embed = d]) {\n    return unembed(t, 10, tied = true)\n  }\n}",
        "m.tsl:3:12: error: this op reads `@embed/table` as [vocab=10, embed=64], but no op declares it"),
    "loop without a cap": (
        _LOOP + FWD + "    return loop(b, x, until = halt)\n  }\n}",
        "m.tsl:10:12: error: a loop needs a cap on its iterations: add `max = N` (at most N steps; FLOPs count N)"),
    "loop state that changes shape": (
        _LOOP.replace("return tanh(x)", "return sum(x, over = [embed])") + FWD
        + "    return loop(b, x, until = halt, max = 4)\n  }\n}",
        "m.tsl:3:12: error: block `b` is looped, so it must return what it takes: value 0 should be "
        "f32[batch, seq, embed=64], got a tensor f32[batch, seq]"),
    "loop state that changes element type": (
        _LOOP.replace("return tanh(x)", "return tanh(x), sum(x, over = [embed])").replace(
            "b(x: [batch, seq, embed])", "b(x: [batch, seq, embed], t: i32[batch, seq])").replace(
            "halt(x: [batch, seq, embed])", "halt(x: [batch, seq, embed], t: i32[batch, seq])")
        + FWD + "    y, u = loop(b, x, t, until = halt, max = 4)\n    return y\n  }\n}",
        "m.tsl:3:21: error: block `b` is looped, so it must return what it takes: value 1 should be i32[batch, seq], "
        "got a tensor f32[batch, seq]"),
    "halting predicate on a dim the state lacks": (
        _LOOP.replace("sum(x, over = [embed, seq])", "rename(sum(x, over = [batch, seq]), embed, cells)") + FWD
        + "    return loop(b, x, until = halt, max = 4)\n  }\n}",
        "m.tsl:6:12: error: halting block `halt`: the halting predicate f32[cells=64] has dim `cells=64`, but carried "
        "value 0 is f32[batch, seq, embed=64]: every carried value needs the predicate's dims (each entry halts the "
        "state it indexes)"),
    "one-step gradient of a stacked repeat": (
        _LOOP + FWD + "    return repeat(2, b, x, grad = last)\n  }\n}",
        "m.tsl:10:28: error: `grad = last` needs `shared = true`: the one-step gradient of a stacked repeat would "
        "leave its other layers without one"),
    "block without return": ("  block b(x: [batch, seq, embed]) {\n    y = x\n  }\n" + FWD + "    return b(x)\n  }\n}",
                             "m.tsl:2:3: error: block `b` has no `return`"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_semantic_error(name):
    body, expected = CASES[name]
    assert _first_line(body) == expected


def test_error_shows_the_source_line_and_a_caret():
    with pytest.raises(TesseraError) as info:
        elaborate(parse_model(HEAD + CASES["unknown name"][0], "m.tsl"), {})
    assert info.value.render().splitlines()[1:] == ["        return embed(t, 10, dd)", "                            ^~"]


def test_model_arguments_are_checked():
    body = FWD + "    return x\n  }\n}"
    assert _first_line(body, {"dd": 3}) == "m.tsl:1:1: error: model `m` has no argument `dd`; did you mean `d`?"
    assert _first_line(body, {"d": 2.5}) == "m.tsl:1:9: error: argument `d` must be an int, got 2.5"
    required = "model m(d: int) {\n" + FWD + "    return x\n  }\n}"
    with pytest.raises(TesseraError, match="model `m` needs argument `d`"):
        elaborate(parse_model(required, "m.tsl"), {})


def test_errors_from_model_arguments_also_point_into_the_spec():
    spec = {"h": Span("spec.yaml", 3, 10), "kv": Span("spec.yaml", 4, 13)}
    with pytest.raises(TesseraError) as info:
        elaborate(parse_model(HEAD + CASES["heads not a multiple of kv_heads"][0], "m.tsl"), {"h": 4, "kv": 3},
                  arg_span=spec.get)
    lines = [d.render().splitlines()[0] for d in info.value.diagnostics]
    assert lines == ["m.tsl:4:12: error: `attention`: heads (4) must be a multiple of kv_heads (3)",
                     "spec.yaml:3:10: note: model.args.h: `h` = 4 is set here",
                     "spec.yaml:4:13: note: model.args.kv: `kv` = 3 is set here"]
