"""Every kind of every struct family the checker accepts lowers (a `llama3` rope once passed the checks and
then failed in the lowering): tiny graphs using the kind, in the composite op that reads the family and in
the primitive op, run and give finite results."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tessera.ir import parse_graph, verify
from tessera.ir.printer import format_attr
from tessera.ir.registry import check_value, struct_families
from tessera.ir.types import Struct
from tessera.lower.context import LowerCtx
from tessera.lower.interpret import eval_region

# family -> graphs reading one attribute of that family: `$struct` is the attribute's value, `$kind` and
# `$fields` its kind and fields (an act kind is also the primitive op of its name, its fields the op's attributes)
GRAPHS = {
    "rope": ["""graph g {
  input %x : f32[batch, seq, embed=8]
  param @attn/q : f32[embed=8, heads=2, head_dim=8] = normal(0.02)
  param @attn/k : f32[embed=8, kv_heads=1, head_dim=8] = normal(0.02)
  param @attn/v : f32[embed=8, kv_heads=1, head_dim=8] = normal(0.02)
  param @attn/o : f32[heads=2, head_dim=8, embed=8] = normal(0.02)
  %0 = attention(%x, @attn/q, @attn/k, @attn/v, @attn/o) {heads = 2, kv_heads = 1, head_dim = 8, rope = $struct,
                   causal = true, window = none, scale = none, sinks = false, bias = false} : f32[batch, seq, embed=8]
  return %0
}""", """graph g {
  input %q : f32[batch, seq, heads=2, head_dim=8]
  %0 = rope(%q) {rope = $struct} : f32[batch, seq, heads=2, head_dim=8]
  return %0
}"""],
    "act": ["""graph g {
  input %x : f32[batch, seq, embed=8]
  param @ffn/gate : f32[embed=8, mlp=16] = normal(0.02)
  param @ffn/up : f32[embed=8, mlp=16] = normal(0.02)
  param @ffn/down : f32[mlp=16, embed=8] = normal(0.02)
  %0 = mlp(%x, @ffn/gate, @ffn/up, @ffn/down) {d_ff = 16, act = $struct, bias = false} : f32[batch, seq, embed=8]
  return %0
}""", """graph g {
  input %gate : f32[batch, seq, mlp=16]
  input %up : f32[batch, seq, mlp=16]
  %0 = $kind(%gate, %up) $fields : f32[batch, seq, mlp=16]
  return %0
}"""],
}

KINDS = [(family, kind) for family, kinds in struct_families().items() for kind in kinds]
SIZES = {"batch": 2, "seq": 6}


def test_every_struct_family_has_tiny_graphs():
    assert set(GRAPHS) == set(struct_families())


def _normal(t, seed: int):
    return jnp.asarray(np.random.default_rng(seed).standard_normal([d.size or SIZES[d.name] for d in t.dims]),
                       jnp.float32)


def _run(text: str) -> np.ndarray:
    """The graph's output with every input and param drawn from a standard normal."""
    graph = verify(parse_graph(text))
    params = {p.path: _normal(p.type, i) for i, p in enumerate(graph.params.values())}
    args = [_normal(v.type, 100 + i) for i, v in enumerate(graph.body.args)]
    (out,), _ = eval_region(graph.body, args, params, LowerCtx())
    return np.asarray(out)


@pytest.mark.parametrize("family, kind", KINDS, ids=[f"{f}-{k}" for f, k in KINDS])
def test_every_struct_kind_lowers(family, kind):
    value = check_value(f"struct:{family}", Struct(kind, ()))  # every field at its default
    struct = format_attr(value)
    for template in GRAPHS[family]:
        text = template.replace("$struct", struct).replace("$kind", kind).replace("$fields", struct[len(kind):])
        out = _run(text)
        assert out.shape[:2] == (SIZES["batch"], SIZES["seq"]) and np.isfinite(out).all()
