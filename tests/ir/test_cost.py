"""Counting from the Graph IR: published GPT-OSS parameter figures, FLOPs by hand, KV cache, per-device bytes."""

from pathlib import Path

import pytest

from tessera.ir import cost
from tessera.ir.elaborate import build_graph
from tessera.lower.program import program_graph
from tessera.spec import load_experiment

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "models" / "llama.tsl"
GPT_OSS = ROOT / "models" / "gpt_oss.tsl"
ONE_LAYER = dict(vocab=16, d_model=8, layers=1, heads=2, kv_heads=1, head_dim=4, d_ff=12)


def spec(tmp_path, model: Path, args: dict, extra: str = "") -> Path:
    """A train spec for `model` with `args` (batch 2, seq 5) written to tmp_path."""
    body = "\n".join(f"    {k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in args.items())
    path = tmp_path / "plan.yaml"
    path.write_text(f"name: t\nmodel:\n  file: {model}\n  args:\n{body}\n"
                    f"task: {{kind: train, batch: 2, seq_len: 5}}\n{extra}")
    return path


@pytest.mark.parametrize("name, total, active, gib", [
    ("gpt_oss_120b", 116_829_156_672, 5_132_639_232, 60.77),
    ("gpt_oss_20b", 20_914_757_184, 3_608_166_144, 12.82),
])
def test_published_gpt_oss_figures(name, total, active, gib):
    graph = program_graph(load_experiment(ROOT / "specs" / f"{name}.yaml"))
    s = cost.param_summary(graph)
    assert (s["total"], s["active"]) == (total, active)
    assert round(s["bytes"] / 2 ** 30, 2) == gib
    assert set(s["bytes_by_dtype"]) == {"bf16", "mxfp4"}


def test_active_fraction_rules():
    graph = build_graph(GPT_OSS, dict(vocab=32, d_model=8, layers=2, heads=2, kv_heads=1, head_dim=4, experts=8,
                                      top_k=2, d_ff=4, window=4))
    frac = {c.path: c.active for c in cost.param_counts(graph)}
    assert frac["embed/table"] == 0.0 and frac["layers/attn_norm/scale"] == 0.0
    assert frac["layers/moe/experts/gate"] == frac["layers/moe/experts/down_bias"] == 2 / 8
    assert frac["layers/moe/router"] == frac["layers/attention/q"] == frac["unembed/weight"] == 1.0
    tied = build_graph(LLAMA, {**ONE_LAYER, "tie_embeddings": True})  # the unembedding reads the table whole
    assert {c.path: c.active for c in cost.param_counts(tied)}["embed/table"] == 1.0


def test_bits_per_element():
    assert cost.bits_per_element("mxfp4") == 4.25
    assert (cost.bits_per_element("bf16"), cost.bits_per_element("f32"), cost.bits_per_element("i32")) == (16, 32, 32)
    with pytest.raises(ValueError):
        cost.bits_per_element("fp5")


def test_flops_of_one_llama_layer_by_hand(tmp_path):
    exp = load_experiment(spec(tmp_path, LLAMA, ONE_LAYER))
    graph = program_graph(exp)
    n, d, f, v, h, kv, hd = 10, 8, 12, 16, 2, 1, 4  # tokens = batch 2 x seq 5
    norms = 3 * 4 * n * d                           # attn_norm, mlp_norm, final_norm
    qkvo = 2 * n * d * hd * (2 * h + 2 * kv)        # q, o: heads; k, v: kv_heads
    core = 4 * 2 * h * hd * (5 * 6 // 2)            # q.k and p.v over the 15 causal pairs per sequence
    residual = 2 * n * d
    mlp = 3 * 2 * n * d * f
    unembed = 2 * n * d * v
    forward = norms + qkvo + core + residual + mlp + unembed
    assert cost.graph_flops_per_token(graph, exp) == forward / n
    counts = cost.flop_counts(graph, cost.task_dims(exp))
    contraction = qkvo + core + mlp + unembed
    assert counts["contraction"] == contraction and counts["other"] == norms + residual
    block = forward - unembed - 4 * n * d           # the layer: all but the final norm and unembed
    train = cost.train_flops(counts, "full")
    assert train["train_step"] == forward + 2 * contraction + (norms + residual)
    assert train["train_step_hardware"] == train["train_step"] + block
    assert cost.train_flops(counts, "dots")["train_step_hardware"] == train["train_step"] + 2 * 4 * n * d + residual


def test_kv_cache_sliding_window_layers_hold_their_window():
    graph = build_graph(GPT_OSS, dict(vocab=32, d_model=16, layers=4, heads=4, kv_heads=2, head_dim=16, experts=4,
                                      top_k=2, d_ff=8, window=8))
    b = 3

    def layer(c):  # k and v f32 [b, c, 2, 16] + int32 positions [b, c]
        return 2 * b * c * 2 * 16 * 4 + b * c * 4

    # even layers slide over 8; whole-sequence caches hold whole 128-key tiles (20 -> 128 slots)
    assert cost.kv_cache_bytes(graph, b, 20) == 2 * layer(8) + 2 * layer(128)
    assert cost.kv_cache_bytes(graph, b, 6) == 4 * layer(128)                 # shorter than the window
    assert cost.kv_cache_bytes(graph, b, 256) == 2 * layer(8) + 2 * layer(256)
    assert [cost.cache_len(n, w) for n, w in [(20, 8), (8, 8), (6, 8), (129, None), (128, None)]] == [8, 8, 128, 256, 128]


def test_per_device_bytes_under_fsdp_and_tp(tmp_path):
    args = dict(vocab=32, d_model=16, layers=2, heads=4, kv_heads=4, head_dim=8, d_ff=32)
    exp = load_experiment(spec(tmp_path, LLAMA, args, "mesh: {fsdp: 2, tp: 4}\nparallel: {deterministic: false}\n"))
    graph, layout = program_graph(exp), cost.Layout.of(exp)
    per = {p.path: layout.per_device(p.type) for p in graph.params.values()}
    assert per["layers/attention/q"] == 2 * 16 * 4 * 8 / (2 * 4)   # embed by fsdp, heads by tp
    assert per["layers/attn_norm/scale"] == 2 * 16 / 2               # embed by fsdp only
    assert per["layers/mlp/down"] == 2 * 32 * 16 / 8                 # mlp by tp, embed by fsdp
    assert per["embed/table"] == 32 * 16 / 8                         # vocab by tp, embed by fsdp
    x = cost.concrete(graph.body.ops[0].result.type, {"batch": 8, "seq": 5})  # activations [batch, seq, embed]
    assert layout.activations(x) == 8 * 5 * 16 / 2                   # batch by fsdp, embed kept whole
    kv = cost.kv_cache_bytes(graph, 8, 128, layout.activations)      # batch by fsdp, kv_heads by tp
    assert kv == 2 * (2 * 4 * 128 * 1 * 8 * 4 + 4 * 128 * 4)


def test_tensor_parallel_collectives_per_layer(tmp_path):
    args = dict(vocab=32, d_model=16, layers=3, heads=4, kv_heads=4, head_dim=8, d_ff=32)
    exp = load_experiment(spec(tmp_path, LLAMA, args, "mesh: {dp: 2, tp: 4}\nparallel: {deterministic: false}\n"))
    graph, layout = program_graph(exp), cost.Layout.of(exp)
    rows = {(r["axis"], r["kind"], r["what"]): r["bytes"]
            for r in cost.collectives(graph, {"batch": 8, "seq": 5}, layout, train=True)}
    out = 4 * 5 * 16 * 4  # f32 [batch/dp, seq, embed] per device
    ring = 2 * 3 / 4
    assert rows[("tp", "all-reduce", "attention output")] == 2 * 3 * ring * out  # fwd + bwd, 3 layers
    assert rows[("tp", "all-reduce", "mlp output")] == 2 * 3 * ring * out
    grads = sum(layout.per_device(p.type) for p in graph.params.values()) * 4
    assert rows[("dp", "all-reduce", "gradients")] == pytest.approx(2 * 1 / 2 * grads)
    assert not any(axis == "fsdp" for axis, _, _ in rows)


def test_sequence_parallel_gathers_each_attentions_keys_and_values(tmp_path):
    """`OpDef.seq_gather`: under sp every attention gathers the whole sequence's k and v (its kv_heads on tp)."""
    path = tmp_path / "sp.yaml"
    path.write_text(f"name: t\nmodel:\n  file: {LLAMA}\n  args: {{vocab: 32, d_model: 16, layers: 2, heads: 4, "
                    "kv_heads: 2, head_dim: 8, d_ff: 32}\ntask: {kind: train, batch: 8, seq_len: 8}\n"
                    "mesh: {sp: 2, tp: 2, dp: 2}\n")
    exp = load_experiment(path)
    graph, layout = program_graph(exp), cost.Layout.of(exp)
    rows = {(r["axis"], r["kind"], r["what"]): r["bytes"]
            for r in cost.collectives(graph, {"batch": 8, "seq": 8}, layout, train=True)}
    whole = 8 // 2 * 8 * 2 // 2 * 8 * 4  # f32 k [batch/dp, whole seq, kv_heads/tp, head_dim] on each device
    # k and v, ring all-gather over sp = 2 ((n-1)/n of the whole), forward and backward, 2 layers
    assert rows[("sp", "all-gather", "attention keys, values")] == 2 * 2 * 2 * whole / 2
    # Megatron sequence parallelism gathers each block's input (the reduce-scatter+all-gather row), not k and v
    path.write_text(path.read_text().replace("mesh: {sp: 2, tp: 2, dp: 2}", "mesh: {tp: 2, dp: 2}\n"
                                             "parallel: {sequence_parallel: true}"))
    exp = load_experiment(path)
    kinds = {(r["axis"], r["kind"], r["what"]) for r in cost.collectives(
        program_graph(exp), {"batch": 8, "seq": 8}, cost.Layout.of(exp), train=True)}
    assert ("tp", "reduce-scatter+all-gather", "attention output") in kinds
    assert not any("keys" in what for _, _, what in kinds)
    # the core op gathers its own k and v operands
    from tessera.ir.registry import get_op
    from tessera.ir.types import sized_type

    q = sized_type("bf16", batch=2, seq=16, heads=8, head_dim=64)
    k = sized_type("bf16", batch=2, seq=16, kv_heads=2, head_dim=64)
    assert get_op("sdpa").seq_gather({}, [q, k, k], "bf16") == [k, k]
    assert get_op("rmsnorm").seq_gather is None and get_op("rmsnorm").state is None


def test_activations_shrink_with_remat(tmp_path):
    exp = load_experiment(spec(tmp_path, LLAMA, {**ONE_LAYER, "layers": 4}))
    graph, sizes = program_graph(exp), cost.task_dims(exp)
    none, dots, full = (cost.activation_bytes(graph, sizes, r) for r in ("none", "dots", "full"))
    assert none["layers"] == 4 and full["per_layer"] == 2 * 5 * 8 * 4  # the layer input, f32
    assert none["total"] > dots["total"] > full["total"] > 0
    # none keeps the MLP's gate and up products, not its activation (recomputed from them); full's recomputing layer
    # holds that activation too while its backward runs
    activation = 2 * 5 * 12 * 4
    assert full["total"] == 4 * full["per_layer"] + none["per_layer"] + activation + none["outside_block"]
