"""Property: any graph the printer can write, the parser reads back to the same text."""

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.ir import Dim, DimName, Graph, Init, Op, Param, ParamRef, PerLayer, Region, Struct, TensorType, Value
from tessera.ir import parse_graph, print_graph

names = st.one_of(st.text(string.ascii_lowercase + "_", min_size=1, max_size=8).filter(
    lambda s: s not in ("none", "true", "false", "per_layer")),
    st.sampled_from(["graph", "input", "param", "attr", "return", "yield", "layers"]))  # keywords are names too
sizes = st.one_of(st.none(), st.integers(1, 10**6))
types = st.builds(lambda dtype, dims: TensorType(dtype, tuple(Dim(n, s) for n, s in dims.items())),
                  st.sampled_from(["f32", "bf16", "i32", "mxfp4", "c64"]), st.dictionaries(names, sizes, max_size=4))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**9, 10**9), st.text(max_size=12),
                    st.floats(allow_nan=False, allow_infinity=False), st.builds(DimName, names))
attr_values = st.one_of(
    scalars,
    st.lists(st.builds(DimName, names), max_size=3).map(tuple),
    st.lists(st.builds(Dim, names, st.integers(1, 64)), min_size=1, max_size=3).map(tuple),
    st.builds(lambda k, f: Struct(k, tuple(f.items())), names, st.dictionaries(names, scalars, max_size=3)),
    st.lists(st.one_of(st.none(), st.integers(0, 512)), min_size=1, max_size=6).map(lambda v: PerLayer(tuple(v))),
)


@st.composite
def graphs(draw):
    inputs = [Value(draw(types), draw(names)) for _ in range(draw(st.integers(1, 3)))]
    params = {p: Param(p, draw(types), draw(st.sampled_from([Init("ones"), Init("zeros"), Init("normal", 0.02)])))
              for p in draw(st.lists(st.builds(lambda a, b: f"{a}/{b}", names, names), max_size=3, unique=True))}
    values, ops = list(inputs), []
    for _ in range(draw(st.integers(0, 5))):
        operands = draw(st.lists(st.sampled_from(values), min_size=1, max_size=3))
        operands += [ParamRef(p) for p in draw(st.lists(st.sampled_from(sorted(params) or ["x/y"]), max_size=2))]
        results = [Value(draw(types)) for _ in range(draw(st.integers(1, 2)))]
        ops.append(Op(draw(names), operands, draw(st.dictionaries(names, attr_values, max_size=4)), results))
        values += results
    return Graph(draw(names), Region(inputs, ops, [draw(st.sampled_from(values))]), params)


@settings(max_examples=100, deadline=None)
@given(graphs())
def test_print_parse_print_is_identity(graph):
    text = print_graph(graph)
    assert print_graph(parse_graph(text)) == text
