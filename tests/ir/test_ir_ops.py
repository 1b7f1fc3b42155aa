"""Op type rules on named-dim shapes, owned params and FLOP hooks, called through the registry."""

import pytest

from tessera.ir import Dim, DimName, OpError, Struct, TensorType, get_op
from tessera.ir.ops_nn import attention_pairs
from tessera.ir.registry import OPS, OpDef, check_attrs, register


def T(spec: str, dtype: str = "f32") -> TensorType:
    """'batch, seq, embed=8' → TensorType."""
    dims = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, size = item.partition("=")
        dims.append(Dim(name, int(size) if size else None))
    return TensorType(dtype, tuple(dims))


def rule(name: str, types, **attrs):
    opdef = get_op(name)
    return opdef.type_rule(types, check_attrs(opdef, attrs))


def dims(*names):
    return tuple(DimName(n) for n in names)


def test_dot_contracts_by_name_and_keeps_batch_dims():
    q, k = T("batch, seq, heads=4, head_dim=8"), T("batch, kv_seq, heads=4, head_dim=8")
    assert rule("dot", [q, k], over=dims("head_dim")) == [T("batch, seq, heads=4, kv_seq")]
    x, w = T("batch, seq, embed=16"), T("experts=2, embed=16, mlp=6")
    assert rule("dot", [x, w], over=dims("embed")) == [T("batch, seq, experts=2, mlp=6")]


@pytest.mark.parametrize("a, b, over, message", [
    ("batch, embed=8", "mlp=4, hidden=8", ("embed",), "second operand f32[mlp=4, hidden=8] has no dimension `embed`"),
    ("batch, embed=8", "embed=4, mlp=2", ("embed",),
     "dimension `embed` is 8 in one of the operands but 4 in the other"),
    ("batch=2, embed=8", "batch=3, embed=8", ("embed",), "dimension `batch` is 2 in one of the operands but 3"),
    ("batch, embed=8", "embed=8", (), "`over` must name at least one dimension to contract"),
])
def test_dot_errors(a, b, over, message):
    with pytest.raises(OpError, match=message.replace("[", r"\[").replace("]", r"\]")):
        rule("dot", [T(a), T(b)], over=dims(*over))


def test_elementwise_broadcasts_by_name():
    assert rule("add", [T("batch, seq, heads=2, head_dim=4"), T("heads=2, head_dim=4")]) == [
        T("batch, seq, heads=2, head_dim=4")]
    assert rule("mul", [T("batch, experts=4, embed=8"), T("batch, experts=4")]) == [T("batch, experts=4, embed=8")]
    with pytest.raises(OpError, match="must be floating point"):
        rule("silu", [T("batch", "i32")])


def test_softmax_with_a_sink_and_top_k_scatter():
    s = T("batch, seq, heads=4, kv_seq")
    assert rule("softmax", [s, T("heads=4")], dim=DimName("kv_seq")) == [s]
    with pytest.raises(OpError, match="sink f32\\[kv_seq\\] must use only dims"):
        rule("softmax", [s, T("kv_seq")], dim=DimName("kv_seq"))
    vals, idx = rule("top_k", [T("batch, experts=8")], k=2, dim=DimName("experts"))
    assert (vals, idx) == (T("batch, top_k=2"), T("batch, top_k=2", "i32"))
    assert rule("scatter", [vals, idx], dim=DimName("experts"), size=8) == [T("batch, experts=8")]
    with pytest.raises(OpError, match="k = 9 must be between 1 and the size of `experts` \\(8\\)"):
        rule("top_k", [T("batch, experts=8")], k=9, dim=DimName("experts"))


def test_reshape_transpose_rename_repeat_kv():
    x = T("batch, seq, heads=4, head_dim=8")
    assert rule("reshape", [x], **{"from": dims("heads", "head_dim"), "to": (Dim("hidden", 32),)}) == [
        T("batch, seq, hidden=32")]
    with pytest.raises(OpError, match="cannot reshape"):
        rule("reshape", [x], **{"from": dims("heads", "head_dim"), "to": (Dim("hidden", 30),)})
    assert rule("transpose", [x], to=dims("heads", "batch", "seq", "head_dim")) == [
        T("heads=4, batch, seq, head_dim=8")]
    assert rule("rename", [x], **{"from": DimName("seq"), "to": DimName("kv_seq")}) == [
        T("batch, kv_seq, heads=4, head_dim=8")]
    with pytest.raises(OpError, match="heads \\(6\\) must be a multiple of kv_heads \\(4\\)"):
        rule("repeat_kv", [T("batch, seq, kv_heads=4, head_dim=8")], heads=6)


def test_attention_owns_the_contract_params():
    opdef = get_op("attention")
    attrs = check_attrs(opdef, dict(heads=4, kv_heads=2, head_dim=8, sinks=True, bias=True))
    decls = opdef.params(attrs, [T("batch, seq, embed=16")])
    assert [(d.name, [str(x) for x in d.dims]) for d in decls] == [
        ("q", ["embed=16", "heads=4", "head_dim=8"]), ("q_bias", ["heads=4", "head_dim=8"]),
        ("k", ["embed=16", "kv_heads=2", "head_dim=8"]), ("k_bias", ["kv_heads=2", "head_dim=8"]),
        ("v", ["embed=16", "kv_heads=2", "head_dim=8"]), ("v_bias", ["kv_heads=2", "head_dim=8"]),
        ("o", ["heads=4", "head_dim=8", "embed=16"]), ("o_bias", ["embed=16"]), ("sinks", ["heads=4"])]


def test_attribute_checks():
    opdef = get_op("attention")
    with pytest.raises(OpError, match="`attention` needs attribute `heads`"):
        check_attrs(opdef, {})
    expected = "attribute `rope` of `attention`: expected one of `rotary\\(...\\)`, `yarn\\(...\\)`, `llama3"
    with pytest.raises(OpError, match=expected):
        check_attrs(opdef, dict(heads=4, kv_heads=2, head_dim=8, rope=Struct("swiglu", ())))
    attrs = check_attrs(get_op("rmsnorm"), {"eps": 1})
    assert attrs == {"eps": 1.0, "dim": DimName("embed")} and isinstance(attrs["eps"], float)


def test_flops_hooks():
    x = T("batch=2, seq=8, embed=16")
    moe = get_op("moe")
    a = check_attrs(moe, dict(experts=8, top_k=2, d_ff=32))
    # router 2·16·8 + top_k experts 2 · (3 matmuls · 2·16·32) per token, 16 tokens
    assert moe.flops([x], [x], a) == 16 * (2 * 16 * 8 + 2 * 3 * 2 * 16 * 32)
    assert attention_pairs(8, None, True) == 36 and attention_pairs(8, 3, True) == 3 * 4 / 2 + 5 * 3
    dot = get_op("dot")
    w = T("embed=16, mlp=4")
    assert dot.flops([x, w], [T("batch=2, seq=8, mlp=4")], {"over": dims("embed")}) == 2 * 2 * 8 * 4 * 16


def test_registering_an_op_twice_is_an_error():
    with pytest.raises(ValueError, match="op `silu` is registered twice"):
        register(OpDef("silu", (1, 1), (), lambda i, a: i))
    assert "silu" in OPS


def test_flops_per_token_counts_attention_at_the_sequence_length():
    from tessera.ir import build_graph, graph_flops
    from tests.ir.conftest import LLAMA, MODELS

    g = build_graph(MODELS / "llama.tsl", LLAMA)
    one = graph_flops(g, {"batch": 1, "seq": 1})
    # 2 layers × 4 heads × head_dim 16 × 4 FLOPs per visible pair; 64 positions see 65/2 keys on average
    attention = 2 * 4 * 16 * 4 * (64 * 65 / 2 - 64) / 64
    assert graph_flops(g, {"batch": 1, "seq": 64}) / 64 == pytest.approx(one + attention)
