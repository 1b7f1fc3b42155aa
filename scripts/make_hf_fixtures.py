"""Build the Hugging Face parity fixtures under tests/data/hf/ (needs `transformers` and CPU torch).

Tiny random GPT-OSS and Llama models, fp32, eager attention, with EVERY parameter re-randomised
(transformers zero-initialises biases and sinks, which would hide bugs) and expert weights scaled
so the +-7 SwiGLU clamp fires. For each model: config.json + model.safetensors (save_pretrained),
tokens.npy, logits.npy (fp32), generated.npy (greedy `generate`, prompt included) and fixture.json.
GPT-OSS also gets pieces.safetensors (per-layer activations captured with hooks, RoPE tables, a
clamped-SwiGLU probe) and an MXFP4 twin whose oracle is transformers' own dequantisation.

Run:  /path/to/venv-with-transformers/bin/python scripts/make_hf_fixtures.py [--out tests/data/hf]
CI never runs this; the committed fixtures are what the tests read.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import transformers
from transformers.integrations import mxfp4 as hf_mxfp4

SEED = 1234
BATCH, SEQ, PROMPT, NEW = 2, 12, 6, 8

GPT_OSS_ARGS = dict(vocab=64, d_model=32, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2,
                    d_ff=32, window=4)
LLAMA_ARGS = dict(vocab=64, d_model=32, layers=2, heads=4, kv_heads=2, head_dim=8, d_ff=48)


def gpt_oss_config(a: dict) -> transformers.GptOssConfig:
    """A tiny GPT-OSS config: default YaRN RoPE (factor 32, truncate False), alternating sliding layers."""
    return transformers.GptOssConfig(
        vocab_size=a["vocab"], hidden_size=a["d_model"], num_hidden_layers=a["layers"],
        num_attention_heads=a["heads"], num_key_value_heads=a["kv_heads"], head_dim=a["head_dim"],
        num_local_experts=a["experts"], num_experts_per_tok=a["top_k"], intermediate_size=a["d_ff"],
        sliding_window=a["window"], eos_token_id=None, pad_token_id=None, bos_token_id=None)


def llama_config(a: dict, *, tied: bool, llama3_rope: bool) -> transformers.LlamaConfig:
    """A tiny Llama-3 config: theta 500000, optionally tied embeddings and Llama-3.1 RoPE scaling."""
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if llama3_rope:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return transformers.LlamaConfig(
        vocab_size=a["vocab"], hidden_size=a["d_model"], num_hidden_layers=a["layers"],
        num_attention_heads=a["heads"], num_key_value_heads=a["kv_heads"], head_dim=a["head_dim"],
        intermediate_size=a["d_ff"], rms_norm_eps=1e-5, tie_word_embeddings=tied, rope_parameters=rope,
        max_position_embeddings=131072,
        eos_token_id=None, pad_token_id=None, bos_token_id=None)


def build(config, cls):
    """The model in fp32 with eager attention and eager experts, every parameter re-randomised."""
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    torch.manual_seed(SEED)
    model = cls(config).float().eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * _std(name, p))
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.add_(1.0)  # scales around 1, still random
    return model


def _std(name: str, p: torch.Tensor) -> float:
    # fan-in scaled so activations stay O(1); expert gate/up 4x larger so |pre-activation| > 7 happens
    if name.endswith("embed_tokens.weight"):
        return 0.3  # small, so that with tied embeddings the layers (not the input token) drive the logits
    if "norm" in name:
        return 0.2
    if "gate_up_proj" in name and not name.endswith("bias"):
        return 4.0 / math.sqrt(p.shape[-2])
    if name.endswith("experts.down_proj"):
        return 1.0 / math.sqrt(p.shape[-2])
    if name.endswith("bias") or name.endswith("sinks"):
        return 0.5
    return 1.0 / math.sqrt(p.shape[-1])


def run_and_save(model, out: Path, family: str, args: dict, extra: dict | None = None) -> np.ndarray:
    """save_pretrained + tokens, logits, greedy generation and fixture.json; returns the logits."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for junk in ("generation_config.json",):
        (out / junk).unlink(missing_ok=True)
    tokens = torch.randint(0, args["vocab"], (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED + 2))
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
        generated = model.generate(tokens[:, :PROMPT], max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
                                   attention_mask=torch.ones_like(tokens[:, :PROMPT]))
    np.save(out / "tokens.npy", tokens.numpy().astype(np.int32))
    np.save(out / "logits.npy", logits.astype(np.float32))
    np.save(out / "generated.npy", generated.numpy().astype(np.int32))
    meta = {"family": family, "args": args, "prompt_len": PROMPT, "max_new_tokens": NEW,
            "transformers": transformers.__version__, "torch": torch.__version__, **(extra or {})}
    (out / "fixture.json").write_text(json.dumps(meta, indent=2) + "\n")
    return logits


# ---- GPT-OSS pieces: activations captured with hooks ------------------------------------------------

def capture_pieces(model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-layer inputs/outputs of norm, attention core, MoE router and MoE block, plus RoPE tables."""
    saved: dict[str, torch.Tensor] = {}
    hooks = []

    def keep(**named):  # returns None: a hook that returns a value would replace the module's output
        saved.update({k.replace("__", "."): v.detach().clone().contiguous() for k, v in named.items()})

    for i, layer in enumerate(model.model.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"layer{i}__"
        hooks += [
            layer.input_layernorm.register_forward_hook(
                lambda m, a, o, p=p: keep(**{p + "attn_norm__in": a[0], p + "attn_norm__out": o})),
            attn.register_forward_hook(
                lambda m, a, k, o, p=p: keep(**{p + "attn__in": k["hidden_states"], p + "attn__out": o[0]}),
                with_kwargs=True),
            attn.o_proj.register_forward_pre_hook(lambda m, a, p=p: keep(**{p + "attn__core": a[0]})),
            mlp.router.register_forward_hook(lambda m, a, o, p=p: keep(**{
                p + "router__logits": o[0], p + "router__scores": o[1],
                p + "router__indices": o[2].to(torch.int32)})),
            mlp.register_forward_hook(lambda m, a, o, p=p: keep(**{p + "moe__in": a[0], p + "moe__out": o[0]})),
        ]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    rot = model.model.rotary_emb
    positions = torch.arange(SEQ)[None]
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), positions)
    saved.update({"rope.inv_freq": rot.inv_freq.clone(), "rope.cos": cos[0].contiguous(),
                  "rope.sin": sin[0].contiguous(),
                  "rope.attention_scaling": torch.tensor([rot.attention_scaling], dtype=torch.float32)})
    saved.update(swiglu_probe(model.model.layers[0].mlp.experts))
    return saved


def swiglu_probe(experts) -> dict[str, torch.Tensor]:
    """GPT-OSS's _apply_gate on interleaved [gate, up] values spanning -12..12 (both clamps fire)."""
    gen = torch.Generator().manual_seed(SEED + 3)
    gate_up = torch.randn(16, 2 * experts.intermediate_size, generator=gen) * 6.0
    with torch.no_grad():
        return {"swiglu.gate_up": gate_up, "swiglu.out": experts._apply_gate(gate_up).contiguous()}


def rope_tables() -> dict[str, torch.Tensor]:
    """YaRN (GPT-OSS full size, truncate False/True) and Llama-3.1 inverse frequencies from transformers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    out = {}
    for truncate in (False, True):
        cfg = transformers.GptOssConfig(num_hidden_layers=1, rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": truncate, "original_max_position_embeddings": 4096})
        inv, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        out[f"yarn64.truncate{int(truncate)}.inv_freq"] = inv.float()
        out[f"yarn64.truncate{int(truncate)}.scaling"] = torch.tensor([scale], dtype=torch.float32)
    cfg = llama_config(dict(LLAMA_ARGS, head_dim=64), tied=False, llama3_rope=True)
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    out["llama3_64.inv_freq"] = inv.float()
    return out


def check_clamp_fires(pieces: dict[str, torch.Tensor], model) -> None:
    """Fail loudly unless some expert gate/up pre-activations exceed +-7 on the fixture tokens."""
    ex = model.model.layers[0].mlp.experts
    x = model.model.layers[0].post_attention_layernorm(pieces["layer0.moe.in"]).reshape(-1, ex.hidden_size)
    with torch.no_grad():
        pre = torch.einsum("td,edf->tef", x, ex.gate_up_proj) + ex.gate_up_proj_bias
    frac = float((pre.abs() > ex.limit).float().mean())
    assert 0.02 < frac < 0.6, f"clamp fires on {frac:.1%} of pre-activations; rescale the experts"
    print(f"  clamp fires on {frac:.1%} of expert pre-activations")


# ---- MXFP4 ------------------------------------------------------------------------------------------

E2M1 = np.array(hf_mxfp4.FP4_VALUES[:8], dtype=np.float32)  # magnitudes of codes 0..7; code | 8 = negative


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF-layout weight [E, in, out] -> blocks uint8 [E, out, in/32, 16], scales uint8 (E8M0) [E, out, in/32]."""
    wt = np.swapaxes(w, 1, 2)  # [E, out, in]; groups of 32 along the input dim
    e, o, i = wt.shape
    g = wt.reshape(e, o, i // 32, 32)
    amax = np.abs(g).max(-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    scaled = g / np.ldexp(1.0, exp)[..., None]
    codes = np.abs(np.abs(scaled)[..., None] - E2M1).argmin(-1).astype(np.uint8)  # nearest magnitude
    codes |= (scaled < 0).astype(np.uint8) << 3
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # low nibble = even element
    return blocks.astype(np.uint8), (exp + 127).astype(np.uint8)


def make_mxfp4_twin(model, src: Path, out: Path, args: dict) -> None:
    """The GPT-OSS fixture with expert matrices as MXFP4 blocks/scales; oracle = transformers' dequantisation."""
    out.mkdir(parents=True, exist_ok=True)
    state = safetensors.torch.load_file(src / "model.safetensors")
    oracle = {}
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = quantize_mxfp4(state.pop(name).numpy())
            state[name + "_blocks"] = torch.from_numpy(blocks)
            state[name + "_scales"] = torch.from_numpy(scales)
            deq = hf_mxfp4.convert_moe_packed_tensors(state[name + "_blocks"], state[name + "_scales"],
                                                      dtype=torch.float32)
            oracle[name] = deq.contiguous()
            with torch.no_grad():
                getattr(ex, proj).copy_(deq)
    safetensors.torch.save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    safetensors.torch.save_file(oracle, out / "dequantized.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokens.npy",):
        shutil.copy(src / name, out / name)
    tokens = torch.from_numpy(np.load(src / "tokens.npy")).long()
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
        generated = model.generate(tokens[:, :PROMPT], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                   attention_mask=torch.ones_like(tokens[:, :PROMPT]))
    np.save(out / "logits.npy", logits)
    np.save(out / "generated.npy", generated.numpy().astype(np.int32))
    meta = json.loads((src / "fixture.json").read_text())
    meta["mxfp4"] = "experts dequantised by transformers.integrations.mxfp4.convert_moe_packed_tensors"
    (out / "fixture.json").write_text(json.dumps(meta, indent=2) + "\n")


def check_mxfp4_loads_in_transformers(out: Path) -> None:
    """Open the MXFP4 twin with from_pretrained (dequantising loader; needs `accelerate`) and compare logits."""
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                  attn_implementation="eager")
    except ImportError as exc:
        print(f"  skipped from_pretrained check of the MXFP4 twin: {exc}")
        return
    tokens = torch.from_numpy(np.load(out / "tokens.npy")).long()
    with torch.no_grad():
        diff = np.abs(model(tokens).logits.float().numpy() - np.load(out / "logits.npy")).max()
    assert diff < 1e-5, f"from_pretrained on the MXFP4 twin differs by {diff}"
    print(f"  from_pretrained on the MXFP4 twin matches its logits (max abs diff {diff:.2e})")


def main() -> None:
    """Write every fixture under --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/data/hf")
    out = parser.parse_args().out
    torch.set_num_threads(1)

    print("gpt_oss")
    model = build(gpt_oss_config(GPT_OSS_ARGS), transformers.GptOssForCausalLM)
    run_and_save(model, out / "gpt_oss", "gpt_oss", GPT_OSS_ARGS)
    tokens = torch.from_numpy(np.load(out / "gpt_oss/tokens.npy")).long()
    pieces = capture_pieces(model, tokens)
    check_clamp_fires(pieces, model)
    pieces.update(rope_tables())
    safetensors.torch.save_file(pieces, out / "gpt_oss/pieces.safetensors", metadata={"format": "pt"})
    print("gpt_oss_mxfp4")
    make_mxfp4_twin(model, out / "gpt_oss", out / "gpt_oss_mxfp4", GPT_OSS_ARGS)
    check_mxfp4_loads_in_transformers(out / "gpt_oss_mxfp4")

    for name, tied in (("llama", False), ("llama_tied", True)):  # Llama-3.1 RoPE scaling: see rope_tables
        print(name)
        args = dict(LLAMA_ARGS, tie_embeddings=tied)
        model = build(llama_config(LLAMA_ARGS, tied=tied, llama3_rope=False), transformers.LlamaForCausalLM)
        run_and_save(model, out / name, "llama", args)
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"total fixture size {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
