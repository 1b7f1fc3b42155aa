"""Hugging Face checkpoints: MXFP4 decoding, name/layout mapping, every loader error, save -> load round trip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tessera.diagnostics import TesseraError
from tessera.lower.hf.mxfp4 import decode_mxfp4, encode_mxfp4
from tessera.lower.options import CompileOptions
from tessera.lower.weights import (expected_params, hf_config_from_args, load_hf_weights, model_args, save_hf_weights,
                                   save_weights)
from tessera.spec import load_experiment

from .conftest import HF_DATA, hf_fixture

FIXTURES = ["gpt_oss", "gpt_oss_mxfp4", "llama", "llama_tied"]
GPT_ARGS = hf_fixture("gpt_oss")["meta"]["args"]
MODELS = Path(__file__).resolve().parents[2] / "models"


def _copy(tmp_path, name="gpt_oss"):
    dst = tmp_path / name
    shutil.copytree(HF_DATA / name, dst)
    return dst


def _messages(exc_info) -> list[str]:
    return [d.message for d in exc_info.value.diagnostics]


def test_mxfp4_decode_matches_transformers_dequantisation():
    raw = load_file(HF_DATA / "gpt_oss_mxfp4" / "model.safetensors")
    oracle = load_file(HF_DATA / "gpt_oss_mxfp4" / "dequantized.safetensors")
    assert len(oracle) == 4
    for name, want in oracle.items():
        got = decode_mxfp4(raw[name + "_blocks"], raw[name + "_scales"])
        np.testing.assert_array_equal(got, want)


def test_mxfp4_encoding_is_exact_on_representable_values():
    rng = np.random.default_rng(0)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    scale = np.float32(2.0) ** np.repeat(rng.integers(-3, 3, (2, 2, 3)), 32, axis=1)  # per group of 32 inputs
    w = (rng.choice(grid, size=(2, 64, 3)) * scale).astype(np.float32)
    w[:, [0, 32], :] = 6.0 * scale[:, [0, 32], :]  # each group's max is exactly 6 * its scale
    blocks, scales = encode_mxfp4(w)
    assert blocks.shape == (2, 3, 2, 16) and scales.shape == (2, 3, 2)
    np.testing.assert_array_equal(decode_mxfp4(blocks, scales), w)


def test_mxfp4_low_nibble_is_the_even_element():
    blocks = np.zeros((1, 1, 1, 16), np.uint8)
    blocks[..., 0] = 0x2 | (0xB << 4)  # code 2 (=1.0) first, code 11 (= -1.5) second
    got = decode_mxfp4(blocks, np.full((1, 1, 1), 128, np.uint8))  # scale 2^1
    np.testing.assert_array_equal(got[0, :2, 0], [2.0, -3.0])


@pytest.mark.parametrize("name", FIXTURES)
def test_fixtures_load_with_expected_paths_and_shapes(name):
    fx = hf_fixture(name)
    params = load_hf_weights(fx["dir"], family=fx["meta"]["family"], args=fx["meta"]["args"])
    want = expected_params(fx["meta"]["family"], fx["meta"]["args"])
    assert {p: tuple(v.shape) for p, v in params.items()} == want


def test_layouts_follow_the_contract():
    fx = hf_fixture("gpt_oss")
    raw = load_file(fx["dir"] / "model.safetensors")
    p = load_hf_weights(fx["dir"], family="gpt_oss", args=GPT_ARGS)
    L1 = "model.layers.1."
    np.testing.assert_array_equal(p["layers/attention/q"][1], raw[L1 + "self_attn.q_proj.weight"].T.reshape(32, 4, 16))
    np.testing.assert_array_equal(p["layers/attention/o"][1], raw[L1 + "self_attn.o_proj.weight"].T.reshape(4, 16, 32))
    np.testing.assert_array_equal(p["layers/moe/experts/gate"][1], raw[L1 + "mlp.experts.gate_up_proj"][..., 0::2])
    np.testing.assert_array_equal(p["layers/moe/experts/up_bias"][1], raw[L1 + "mlp.experts.gate_up_proj_bias"][:, 1::2])
    np.testing.assert_array_equal(p["layers/moe/router"][1], raw[L1 + "mlp.router.weight"].T)
    np.testing.assert_array_equal(p["unembed/weight"], raw["lm_head.weight"].T)


def test_dtypes_callable_decides_each_parameter():
    fx = hf_fixture("gpt_oss_mxfp4")
    p = load_hf_weights(fx["dir"], family="gpt_oss", args=GPT_ARGS,
                        dtypes=lambda path: jnp.bfloat16 if path.startswith("layers/moe/experts/") else np.float32)
    assert p["layers/moe/experts/down"].dtype == jnp.bfloat16 and p["embed/table"].dtype == jnp.float32


def test_config_mismatches_are_all_named(tmp_path):
    args = dict(GPT_ARGS, heads=8, experts=16)
    with pytest.raises(TesseraError) as exc:
        load_hf_weights(HF_DATA / "gpt_oss", family="gpt_oss", args=args)
    assert _messages(exc) == ["config.json has num_attention_heads = 4 but model.args.heads = 8",
                              "config.json has num_local_experts = 4 but model.args.experts = 16"]
    span = exc.value.diagnostics[0].span
    lines = (HF_DATA / "gpt_oss" / "config.json").read_text().splitlines()
    assert lines[span.line - 1][span.col - 1:].startswith('"num_attention_heads"')
    assert exc.value.diagnostics[1].key == "model.args.experts"


def test_wrong_family_and_missing_args():
    with pytest.raises(TesseraError) as exc:
        load_hf_weights(HF_DATA / "llama", family="gpt_oss", args=GPT_ARGS)
    assert _messages(exc)[0] == "config.json has model_type = 'llama', expected 'gpt_oss'"
    with pytest.raises(TesseraError) as exc:
        load_hf_weights(HF_DATA / "gpt_oss", family="gpt_oss", args={k: v for k, v in GPT_ARGS.items() if k != "d_ff"})
    assert _messages(exc) == ["model.args has no `d_ff`, which a gpt_oss checkpoint needs"]
    with pytest.raises(TesseraError, match="no Hugging Face mapping for model family `mamba`"):
        load_hf_weights(HF_DATA / "gpt_oss", family="mamba", args=GPT_ARGS)


def test_missing_unexpected_and_misshaped_tensors(tmp_path):
    d = _copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.sinks"]
    tensors["model.layers.0.self_attn.sink"] = np.zeros(4, np.float32)
    tensors["model.layers.0.mlp.router.bias"] = np.zeros(5, np.float32)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(8, np.float32)  # tolerated, as HF does
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(TesseraError) as exc:
        load_hf_weights(d, family="gpt_oss", args=GPT_ARGS)
    where = str(d)
    assert _messages(exc) == [
        "missing tensor `model.layers.1.self_attn.sinks` (shape [4], for `layers/attention/sinks`) in " + where,
        f"tensor `model.layers.0.mlp.router.bias` in {where}/model.safetensors has shape [5], expected [4] "
        "from model.args",
        f"unexpected tensor `model.layers.0.self_attn.sink` in {where}/model.safetensors",
    ]
    assert exc.value.diagnostics[2].hint == "did you mean `model.layers.0.self_attn.sinks`?"


@pytest.mark.parametrize("cut,want", [
    (lambda raw: raw[: len(raw) - 100], "ends at byte {end:,}, but the file ends at byte {size:,} (truncated: 100 bytes"),
    (lambda raw: raw[:5], "the file is 5 bytes, shorter than the 8-byte header length"),
    (lambda raw: raw[:40], "the header length says {n:,} bytes of JSON from byte 8, but the file ends at byte 40"),
    (lambda raw: raw[:8] + b"{\"x\" 1" + raw[14:], "the JSON header is invalid at byte 13"),
    (lambda raw: raw + b"\0" * 7, "the data ends at byte {end:,}, but the file goes on to byte {size:,}"),
])
def test_damaged_safetensors_is_named_with_the_byte_offset(tmp_path, cut, want):
    d = _copy(tmp_path)
    path = d / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    damaged = cut(raw)
    path.write_bytes(damaged)
    with pytest.raises(TesseraError) as exc:
        load_hf_weights(d, family="gpt_oss", args=GPT_ARGS)
    (message,) = _messages(exc)
    assert message.startswith(f"{path} cannot be read as safetensors: "), message
    assert want.format(end=len(raw), size=len(damaged), n=n) in message, message


def test_missing_files(tmp_path):
    with pytest.raises(TesseraError) as exc:
        load_hf_weights(tmp_path, family="llama", args={})
    assert _messages(exc) == [f"no config.json in {tmp_path}"]
    shutil.copy(HF_DATA / "llama" / "config.json", tmp_path / "config.json")
    with pytest.raises(TesseraError) as exc:
        load_hf_weights(tmp_path, family="llama", args=hf_fixture("llama")["meta"]["args"])
    assert _messages(exc) == [f"no model.safetensors or model.safetensors.index.json in {tmp_path}"]


def test_sharded_checkpoint_with_index(tmp_path):
    d = _copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / file)
    (d / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_hf_weights(d, family="gpt_oss", args=GPT_ARGS)
    single = load_hf_weights(HF_DATA / "gpt_oss", family="gpt_oss", args=GPT_ARGS)
    for path in single:
        np.testing.assert_array_equal(sharded[path], single[path])


@pytest.mark.parametrize("name", ["gpt_oss", "llama", "llama_tied"])
def test_save_writes_the_same_tensors_hf_wrote(tmp_path, name):
    fx = hf_fixture(name)
    family, args = fx["meta"]["family"], fx["meta"]["args"]
    params = load_hf_weights(fx["dir"], family=family, args=args)
    out = save_hf_weights(params, tmp_path / "saved", family=family, args=args, model=MODELS / f"{family}.tsl")
    ours, theirs = load_file(out / "model.safetensors"), load_file(fx["dir"] / "model.safetensors")
    if args.get("tie_embeddings"):
        theirs.pop("lm_head.weight", None)
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    again = load_hf_weights(out, family=family, args=args)
    assert all(np.array_equal(again[p], params[p]) for p in params)
    config = json.loads((out / "config.json").read_text())
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_key_value_heads", "intermediate_size",
                "rope_parameters", "rms_norm_eps", "tie_word_embeddings"):
        assert config[key] == fx["config"][key], key


def test_hf_config_from_args_gpt_oss():
    config = hf_config_from_args("gpt_oss", model_args("gpt_oss", GPT_ARGS, MODELS / "gpt_oss.tsl"))
    want = hf_fixture("gpt_oss")["config"]
    for key in ("layer_types", "rope_parameters", "sliding_window", "num_local_experts", "num_experts_per_tok",
                "head_dim", "vocab_size", "attention_bias", "swiglu_limit", "rms_norm_eps"):
        assert config[key] == want[key], key
    assert config["architectures"] == ["GptOssForCausalLM"]


def test_save_rejects_wrong_params_and_wrapper_uses_model_file_stem(tmp_path):
    params = load_hf_weights(HF_DATA / "llama", family="llama", args=hf_fixture("llama")["meta"]["args"])
    args = hf_fixture("llama")["meta"]["args"]
    bad = dict(params, **{"layers/mlp/gates": params["layers/mlp/gate"]})
    del bad["final_norm/scale"]
    with pytest.raises(TesseraError) as exc:
        save_hf_weights(bad, tmp_path, family="llama", args=args)
    assert _messages(exc) == ["parameter `final_norm/scale` is missing (shape [32])",
                              "parameter `layers/mlp/gates` has no place in a Hugging Face checkpoint"]
    exp = load_experiment(MODELS.parent / "specs" / "llama_tiny.yaml",
                          overrides={f"model.args.{k}": v for k, v in args.items()})
    out = save_weights(params, tmp_path / "w", options=CompileOptions.of(exp))
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def _edit_config(d, edit):
    config = json.loads((d / "config.json").read_text())
    edit(config)
    (d / "config.json").write_text(json.dumps(config, indent=2))


def test_architecture_choices_and_defaults_of_the_model_file_are_checked(tmp_path):
    d = _copy(tmp_path, "llama")
    _edit_config(d, lambda c: c.update(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0},
                                       rms_norm_eps=1e-6))
    args = hf_fixture("llama")["meta"]["args"]  # omits norm_eps and rope_theta: llama.tsl's defaults apply
    with pytest.raises(TesseraError) as exc:
        load_hf_weights(d, family="llama", args=args, model=MODELS / "llama.tsl")
    assert _messages(exc) == ["config.json has rms_norm_eps = 1e-06 but model.args.norm_eps = 1e-05",
                              "config.json has rope_parameters.rope_type = 'llama3' but the llama model implements "
                              "'default'"]
    load_hf_weights(HF_DATA / "llama", family="llama", args=dict(args, rope_theta=500000, norm_eps=1e-5))


def test_older_gpt_oss_config_layout_is_understood(tmp_path):
    # released GPT-OSS checkpoints write rope_theta at the top level and the YaRN settings under rope_scaling
    d = _copy(tmp_path)

    def old_style(c):
        rope = c.pop("rope_parameters")
        c["rope_theta"] = rope.pop("rope_theta")
        c["rope_scaling"] = rope
    _edit_config(d, old_style)
    load_hf_weights(d, family="gpt_oss", args=GPT_ARGS)
    with pytest.raises(TesseraError) as exc:
        load_hf_weights(d, family="gpt_oss", args=dict(GPT_ARGS, rope_theta=10000.0, window=8))
    assert _messages(exc) == ["config.json has sliding_window = 4 but model.args.window = 8",
                              "config.json has rope_parameters.rope_theta = 150000.0 but model.args.rope_theta = "
                              "10000.0"]
