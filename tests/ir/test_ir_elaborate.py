"""Elaboration: per-layer tables from the layer index, several carried values, lazy conditionals, sizes."""

from tessera.grammar.model import parse_model
from tessera.ir import PerLayer, build_graph, parse_graph, print_graph, verify
from tessera.ir.elaborate import elaborate
from tests.ir.conftest import LLAMA, MODELS

RECURRENT = """
model two_speed(d: int = 8, cycles: int = 4) {
  block step(z: [batch, embed], h: [batch, embed], i: index) {
    z = z + silu(h) * (i % 2 == 0 ? 1.0 : 0.5)      # per-layer constant
    return z, h + rmsnorm(z) as norm
  }
  forward(x: [batch, embed = d]) {
    z, h = repeat(cycles, step, x, x) as cycles
    return z, h
  }
}
"""


def _graph(src: str, args=None, **kw):
    return verify(elaborate(parse_model(src, "m.tsl"), args or {}, **kw))


def test_repeat_carries_several_values_and_layer_index_tables():
    g = _graph(RECURRENT)
    (rep,) = g.body.ops
    assert rep.name == "repeat" and len(rep.results) == 2 and len(g.outputs) == 2
    assert [a.name for a in rep.region.args] == ["i", "z", "h"]
    scale = next(op for op in rep.region.ops if op.name == "scale")
    assert scale.attrs["by"] == PerLayer((1.0, 0.5, 1.0, 0.5))
    assert list(g.params) == ["cycles/norm/scale"]
    assert [d.name for d in g.params["cycles/norm/scale"].type.dims] == ["layers", "embed"]
    assert print_graph(parse_graph(print_graph(g))) == print_graph(g)


def test_only_the_chosen_branch_of_a_conditional_is_elaborated():
    tied = build_graph(MODELS / "llama.tsl", {**LLAMA, "tie_embeddings": True})
    untied = build_graph(MODELS / "llama.tsl", LLAMA)
    assert len(untied.params) == len(tied.params) + 1


def test_dynamic_dims_take_sizes_when_given():
    g = build_graph(MODELS / "llama.tsl", LLAMA, dims={"batch": 2, "seq": 16})
    assert str(g.inputs[0].type) == "i32[batch=2, seq=16]"
    assert str(g.outputs[0].type) == "f32[batch=2, seq=16, vocab=256]"


def test_compile_time_arithmetic():
    src = """
model m(d: int = 64, h: int = 4) {
  forward(t: i32[batch, seq]) {
    x = embed(t, 2 ** 4, d // h * h + d % h)
    return rmsnorm(x, eps = 1 / 2 ** 10)
  }
}"""
    g = _graph(src)
    emb, norm = g.body.ops
    assert emb.attrs["vocab"] == 16 and emb.attrs["dim"] == 64
    assert norm.attrs["eps"] == 1 / 1024
