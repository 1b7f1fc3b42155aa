"""The shipped models: parameter paths and layouts are the contract (docs/contracts.md), and every
pass leaves a graph that prints, parses back and prints identically."""

import math

import pytest

from tessera.ir import build_graph, graph_flops, parse_graph, print_graph, verify
from tessera.ir.passes import PIPELINE, PassContext, stages
from tests.ir.conftest import GPT_OSS, GRID, LLAMA, MODELS, POLICY

L, E, H, K, D, X, F, V = "layers", "embed", "heads", "kv_heads", "head_dim", "experts", "mlp", "vocab"

GPT_OSS_PARAMS = {
    "embed/table": [V, E],
    "layers/attn_norm/scale": [L, E],
    "layers/attention/q": [L, E, H, D], "layers/attention/q_bias": [L, H, D],
    "layers/attention/k": [L, E, K, D], "layers/attention/k_bias": [L, K, D],
    "layers/attention/v": [L, E, K, D], "layers/attention/v_bias": [L, K, D],
    "layers/attention/o": [L, H, D, E], "layers/attention/o_bias": [L, E],
    "layers/attention/sinks": [L, H],
    "layers/mlp_norm/scale": [L, E],
    "layers/moe/router": [L, E, X], "layers/moe/router_bias": [L, X],
    "layers/moe/experts/gate": [L, X, E, F], "layers/moe/experts/gate_bias": [L, X, F],
    "layers/moe/experts/up": [L, X, E, F], "layers/moe/experts/up_bias": [L, X, F],
    "layers/moe/experts/down": [L, X, F, E], "layers/moe/experts/down_bias": [L, X, E],
    "final_norm/scale": [E],
    "unembed/weight": [E, V],
}
LLAMA_PARAMS = {
    "embed/table": [V, E], "layers/attn_norm/scale": [L, E],
    "layers/attention/q": [L, E, H, D], "layers/attention/k": [L, E, K, D], "layers/attention/v": [L, E, K, D],
    "layers/attention/o": [L, H, D, E], "layers/mlp_norm/scale": [L, E],
    "layers/mlp/gate": [L, E, F], "layers/mlp/up": [L, E, F], "layers/mlp/down": [L, F, E],
    "final_norm/scale": [E], "unembed/weight": [E, V],
}


def _axes(graph):
    return {path: list(p.axes) for path, p in graph.params.items()}


def test_gpt_oss_params_follow_the_contract():
    g = build_graph(MODELS / "gpt_oss.tsl", GPT_OSS)
    assert _axes(g) == GPT_OSS_PARAMS
    sizes = [d.size for d in g.params["layers/attention/q"].type.dims]
    assert sizes == [4, 64, 4, 16]
    assert str(g.params["layers/attn_norm/scale"].init) == "ones"
    assert str(g.params["layers/attention/sinks"].init) == "zeros"


def test_llama_params_follow_the_contract_tied_and_untied():
    untied = build_graph(MODELS / "llama.tsl", LLAMA)
    assert _axes(untied) == LLAMA_PARAMS
    tied = build_graph(MODELS / "llama.tsl", {**LLAMA, "tie_embeddings": True})
    assert "unembed/weight" not in tied.params
    unembed = tied.body.ops[-1]
    assert unembed.name == "unembed" and unembed.operands[1].path == "embed/table"


def test_gpt_oss_alternates_sliding_and_full_attention_in_one_repeat():
    g = build_graph(MODELS / "gpt_oss.tsl", GPT_OSS)
    repeats = [op for op in g.body.ops if op.name == "repeat"]
    assert len(repeats) == 1 and repeats[0].attrs["n"] == 4
    attn = next(op for op in repeats[0].region.ops if op.name == "attention")
    assert attn.attrs["window"].values == (8, None, 8, None)  # sliding on even layers
    assert attn.attrs["sinks"] is True and attn.attrs["bias"] is True
    rope = attn.attrs["rope"]
    assert rope.kind == "yarn" and dict(rope.fields) == {
        "theta": 150000.0, "factor": 32.0, "original": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    moe = next(op for op in repeats[0].region.ops if op.name == "moe")
    assert dict(moe.attrs["act"].fields) == {"alpha": 1.702, "limit": 7.0}


def test_a_36_layer_model_has_as_many_ops_as_a_2_layer_one():
    small = build_graph(MODELS / "gpt_oss.tsl", {**GPT_OSS, "layers": 2})
    big = build_graph(MODELS / "gpt_oss.tsl", {**GPT_OSS, "layers": 36})
    assert sum(1 for _ in small.walk()) == sum(1 for _ in big.walk())


def test_gpt_oss_120b_parameter_count_and_flops():
    args = dict(vocab=201088, d_model=2880, layers=36, heads=64, kv_heads=8, head_dim=64, experts=128, top_k=4,
                d_ff=2880)
    g = build_graph(MODELS / "gpt_oss.tsl", args)
    total = sum(p.type.numel() for p in g.params.values())
    assert total == 116_829_156_672  # gpt-oss-120b's published 116.8B
    # one token, no attention context: 2 FLOPs per active parameter (the embedding lookup is free,
    # and only top_k = 4 of 128 experts run)
    expert_params = 36 * 128 * 3 * 2880 * (2880 + 1)  # gate, up, down and their biases
    active = total - 201088 * 2880 - expert_params * (128 - 4) // 128
    flops = graph_flops(g, {"batch": 1, "seq": 1})
    assert flops == pytest.approx(2 * active, rel=0.01)


@pytest.mark.parametrize("policy", [None, POLICY], ids=["no-policy", "bf16-mxfp4"])
def test_every_pass_round_trips(shipped, policy):
    _, path, args = shipped
    graph = build_graph(path, args)
    seen = []
    for name, g in stages(graph, PassContext(numerics=policy)):
        text = print_graph(g)
        again = verify(parse_graph(text))
        assert print_graph(again) == text, name
        assert again == g
        seen.append(name)
    assert seen == PIPELINE


def test_pipeline_ends_with_the_composite_ops_restored(shipped):
    _, path, args = shipped
    graph = build_graph(path, args)
    *_, (_, final) = stages(graph)
    _, (_, canon) = list(stages(graph, upto="canonicalize"))
    assert print_graph(final) == print_graph(canon)  # decompose then fuse is the identity here
    names = [op.name for op in final.walk()]
    assert {"softmax", "mask"}.isdisjoint(names)
    assert names.count("dot") == [op.name for op in graph.walk()].count("dot")  # only those the model writes


def test_numerics_sets_storage_and_compute_types():
    g = build_graph(MODELS / "gpt_oss.tsl", GPT_OSS, numerics=POLICY)
    assert g.params["layers/moe/experts/gate"].type.dtype == "mxfp4"
    assert g.params["layers/moe/experts/gate_bias"].type.dtype == "bf16"
    assert g.params["layers/attention/q"].type.dtype == "f32"
    assert g.outputs[0].type.dtype == "bf16"
    assert g.attrs == {"compute": "bf16", "accum": "f32"}


def test_hrm_holds_one_set_of_weights_per_module_and_the_one_step_gradient():
    g = build_graph(MODELS / "hrm.tsl", {**GRID, "l_layers": 2, "h_layers": 3, "segments": 5})
    axes = _axes(g)
    low, high = "act/reason/cycles/low/net", "act/reason/cycles/high"
    assert axes[f"{low}/attention/q"] == [L, E, H, D]   # the low module's 2 layers, shared by every step
    assert axes[f"{high}/mlp/down"] == [L, F, E]         # the high module's 3 layers
    assert [d.size for d in g.params[f"{high}/mlp/down"].type.dims][0] == 3
    assert axes["act/q_values/q_weight"] == [E, "act"] and axes["act/out/weight"] == [E, V]  # the Q-head, the readout
    assert g.params["act/q_values/q_weight"].init.kind == g.params["act/q_values/q_bias"].init.kind == "zeros"
    recurrences = [op for op in g.walk() if op.name == "repeat" and op.attrs["axis"] is None]
    assert len(recurrences) == 4  # cycles and low-level steps, in the forward's segments and the loss entry's
    assert all(op.attrs["grad"] == "last" for op in recurrences)
    attention = [op for op in g.walk() if op.name == "attention"]
    assert attention and not any(op.attrs["causal"] for op in attention)


def test_hrm_runs_segments_in_a_loop_that_halts_and_supervises_each():
    """Inference: a loop of at most `segments` segments until q_halt - q_continue > 0; training: the loss entry's
    loop of the same segments (the same params), the state detached at each segment's start, four terms."""
    g = build_graph(MODELS / "hrm.tsl", {**GRID, "l_layers": 1, "h_layers": 1, "segments": 5})
    (fwd,) = [op for op in g.body.ops if op.name == "loop"]
    assert fwd.attrs == {"max": 5, "grad": "all"} and [o.name for o in fwd.second.ops] == ["sub"]
    (loss,) = g.losses
    assert loss.name == "supervision" and loss.terms == ("lm", "q_halt", "q_continue", "segments")
    (train,) = [op for op in loss.region.ops if op.name == "loop"]
    assert train.attrs == {"max": 5, "grad": "all"}
    reads = lambda region: {o.path for op in region.walk() for o in op.operands if hasattr(o, "path")}  # noqa: E731
    assert reads(fwd.region) < reads(train.region) == set(g.params) - {"input/embed/table", "input/pos_embed/row",
                                                                        "input/pos_embed/col"}
    body = [op.name for op in train.region.walk()]
    assert body.count("stop_gradient") == 3  # z_H and z_L into each segment, the Q target
    assert {"token_cross_entropy", "exact_match", "softplus", "maximum"} <= set(body)
    text = print_graph(g)
    assert "loss supervision -> [lm, q_halt, q_continue, segments]" in text
    assert print_graph(verify(parse_graph(text))) == text


def test_hrm_options_build_pre_norm_layers_module_norms_and_every_steps_gradient():
    """pre_norm: each layer norms its input (attn_norm before attention), each module's output is normed
    (net_norm, high_norm) and the readout and the Q-head read it normed; input_norm norms the embedded puzzle; one_step = false
    leaves the recurrences' gradient at "all". The default build keeps the paper's post-norm layers and paths."""
    args = {**GRID, "l_layers": 1, "h_layers": 1, "segments": 2}
    g = build_graph(MODELS / "hrm.tsl", {**args, "pre_norm": True, "input_norm": True, "one_step": False})
    new = {"input/input_norm/scale", "act/reason/cycles/low/net_norm/scale", "act/reason/cycles/high_norm/scale",
           "act/out_norm/scale", "act/q_values/q_norm/scale"}
    assert new <= set(g.params)
    recurrences = [op for op in g.walk() if op.name == "repeat" and op.attrs["axis"] is None]
    assert len(recurrences) == 4 and all(op.attrs["grad"] == "all" for op in recurrences)
    base = build_graph(MODELS / "hrm.tsl", args)
    assert not new & set(base.params) and set(g.params) - set(base.params) == new  # the same layer params otherwise
    assert sum(math.prod(d.size for d in p.type.dims) for p in base.params.values()) + 5 * 16 == \
        sum(math.prod(d.size for d in p.type.dims) for p in g.params.values())
