"""Packed MXFP4 parameters end to end: the format against the HF codec, init/forward/generate against the
dequantised weights, HF load → save → load, sharding, the plan's bytes, and the errors a spec can cause."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import tessera
from tessera.diagnostics import TesseraError
from tessera.lower.hf.mxfp4 import decode_mxfp4, encode_mxfp4, packed_from_hf, packed_to_hf
from tessera.lower.reference import mxfp4
from tessera.lower.reference.mxfp4 import MXFP4
from tessera.spec.tasks import ForwardTask
from tests.cpu_env import cpu_env

ROOT = Path(__file__).resolve().parents[2]
HF_MXFP4 = ROOT / "tests" / "data" / "hf" / "gpt_oss_mxfp4"
RULES = '{"*/moe/experts/*": mxfp4, "*/moe/experts/*_bias": fp32}'
SPEC = """name: tiny_mxfp4
model:
  file: {root}/models/gpt_oss.tsl
  args: {{vocab: 64, d_model: 64, layers: 2, heads: 4, kv_heads: 2, head_dim: 16, experts: 8, top_k: 2,
         d_ff: 64, window: 8}}
mesh: {mesh}
parallel:
  rules: {{batch: [dp, fsdp], embed: fsdp, heads: tp, kv_heads: tp, mlp: tp, vocab: tp, experts: ep}}
  deterministic: false
numerics:
  default: fp32
  params: fp32
  rules: {rules}
task: {task}
"""
FORWARD = "{kind: forward, tokens: [[1, 2, 3, 4], [5, 6, 7, 8]]}"
TRAIN = "{kind: train, steps: 1, batch: 2, seq_len: 8, data: {kind: synthetic, task: copy, seed: 1}}"


def write_spec(tmp_path: Path, rules: str = RULES, task: str = FORWARD, mesh: str = "{}") -> Path:
    path = tmp_path / f"tiny_{abs(hash((rules, task, mesh)))}.yaml"
    path.write_text(SPEC.format(root=ROOT, rules=rules, task=task, mesh=mesh))
    return path


def dequantized(params: dict) -> dict:
    return {k: (mxfp4.dequantize(v, jnp.float32) if isinstance(v, MXFP4) else v) for k, v in params.items()}


# ---- the format --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,seed", [((64, 8), 0), ((3, 96, 5), 1), ((2, 2, 32, 48), 2)])
def test_quantize_and_dequantize_match_the_hf_codec_bit_for_bit(shape, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-12, 12, shape[:-2] + (1, shape[-1])))
    w[..., :32, 0] = 0.0  # an all-zero group
    w[..., 1, -1] = 1e-30  # a tiny value next to ordinary ones
    ties = np.asarray([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5] * 4, np.float32) * np.asarray([1, -1] * 16) * 8
    w[..., 32:64, 1] = ties[: w[..., 32:64, 1].shape[-1]]  # exactly between two E2M1 values: to the smaller
    ours = mxfp4.quantize(jnp.asarray(w))
    codes, scales = packed_from_hf(*encode_mxfp4(w))
    np.testing.assert_array_equal(np.asarray(ours.codes), codes)
    np.testing.assert_array_equal(np.asarray(ours.scales), scales)
    hf = decode_mxfp4(*packed_to_hf(codes, scales))
    got = np.asarray(mxfp4.dequantize(ours, jnp.float32))
    np.testing.assert_array_equal(got.view(np.uint32), hf.view(np.uint32))  # -0.0 included
    assert ours.shape == shape and ours.nbytes == w.size * 17 // 32  # 4.25 bits an element


def test_hf_layout_converts_both_ways():
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (3, 40, 4, 16), dtype=np.uint8)  # [E, out, in/32, 16]
    scales = rng.integers(110, 140, (3, 40, 4), dtype=np.uint8)
    codes, sc = packed_from_hf(blocks, scales)
    assert codes.shape == (3, 64, 40) and sc.shape == (3, 4, 40)  # [E, in/2, out], [E, in/32, out]
    back = packed_to_hf(codes, sc)
    np.testing.assert_array_equal(back[0], blocks)
    np.testing.assert_array_equal(back[1], scales)
    np.testing.assert_array_equal(np.asarray(mxfp4.dequantize(MXFP4(codes, sc), jnp.float32)),
                                  decode_mxfp4(blocks, scales))


@pytest.mark.parametrize("rows", [3, 12])  # fewer rows than experts (gathered), and more (ragged_dot)
def test_ragged_dot_on_packed_experts(rows):
    rng = np.random.default_rng(rows)
    experts = mxfp4.quantize(jnp.asarray(rng.standard_normal((6, 64, 16)), jnp.float32))
    lhs = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
    sizes = jnp.asarray([1, 0, 1, 0, rows // 2 - 2, 0] if rows > 3 else [1, 0, 1, 0, 0, 0], jnp.int32)
    got = np.asarray(mxfp4.ragged_dot(lhs, experts, sizes, preferred_element_type=jnp.float32))
    want = np.asarray(jax.lax.ragged_dot(lhs, mxfp4.dequantize(experts, jnp.float32), sizes,
                                         preferred_element_type=jnp.float32))
    n = int(sizes.sum())
    np.testing.assert_allclose(got[:n], want[:n], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[n:], 0.0)  # rows past the groups


# ---- the program ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("specs")
    packed = tessera.compile(tessera.load(write_spec(tmp)))
    dense = tessera.compile(tessera.load(write_spec(tmp, rules="{}")))
    return packed, dense


def test_packed_program_equals_the_dequantised_one(programs):
    packed, dense = programs
    params = packed.init(seed=0)
    kinds = {k: type(v).__name__ for k, v in params.items() if k.startswith("layers/moe/experts/")}
    assert kinds == {"layers/moe/experts/gate": "MXFP4", "layers/moe/experts/up": "MXFP4",
                     "layers/moe/experts/down": "MXFP4", "layers/moe/experts/gate_bias": "ArrayImpl",
                     "layers/moe/experts/up_bias": "ArrayImpl", "layers/moe/experts/down_bias": "ArrayImpl"}
    w = params["layers/moe/experts/gate"]
    assert w.codes.dtype == jnp.uint8 and w.codes.shape == (2, 8, 32, 64) and w.scales.shape == (2, 8, 2, 64)
    plain = dequantized(params)
    # a normal(0, std) draw per layer, quantised: values of the format, not all alike, and differing per layer
    plain_w = np.asarray(plain["layers/moe/experts/gate"])
    assert 0.5 < plain_w.std() / np.asarray(dense.init(seed=0)["layers/moe/experts/gate"]).std() < 1.5
    assert not np.array_equal(plain_w[0], plain_w[1])
    tokens = np.arange(32).reshape(2, 16) % 64
    a, b = np.asarray(packed.forward(params, tokens)), np.asarray(dense.forward(plain, tokens))
    np.testing.assert_array_equal(a, b)  # bit-identical: dequantisation is exact, the math the same
    prompt = tokens[:1, :5]
    np.testing.assert_array_equal(np.asarray(packed.generate(params, prompt, max_new_tokens=6)),
                                  np.asarray(dense.generate(plain, prompt, max_new_tokens=6)))


def test_plan_bytes_equal_the_program_bytes_tiny(programs):
    from tessera.run.plan import build_plan

    packed, _ = programs
    held = jax.eval_shape(packed.init_fn(), jnp.asarray(0, jnp.uint32))
    ours = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(held))
    plan = build_plan(packed.exp, device="cpu")
    assert plan["params"]["bytes"] == ours
    assert plan["memory_per_device"]["params"] == ours


def test_plan_bytes_equal_the_program_bytes_20b():
    from tessera.run.plan import build_plan

    exp = tessera.load(ROOT / "specs" / "gpt_oss_20b.yaml")
    prog = tessera.compile(exp)
    held = jax.eval_shape(prog.init_fn(), jnp.asarray(0, jnp.uint32))  # abstract: nothing is allocated
    ours = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(held))
    plan = build_plan(exp, device="h200")
    assert plan["params"]["bytes"] == ours
    assert round(ours / 2**30, 2) == 12.82  # the model card's figure


# ---- Hugging Face checkpoints ------------------------------------------------------------------------------

def _mxfp4_fixture_program(directory: Path = HF_MXFP4):
    fixture = json.loads((directory / "fixture.json").read_text())
    overrides = {f"model.args.{k}": v for k, v in fixture["args"].items()}
    overrides["numerics.rules"] = {"*/moe/experts/*": "mxfp4", "*/moe/experts/*_bias": "fp32"}
    overrides["task.sample.prompt"] = [1, 2, 3]
    exp = tessera.load(ROOT / "specs" / "gpt_oss_tiny.yaml", overrides=overrides)
    return tessera.compile(exp.model_copy(update={"task": ForwardTask(kind="forward", tokens=[[1, 2]])}))


def test_load_keeps_the_checkpoint_bytes_and_save_writes_them_back(tmp_path):
    from tessera.lower.weights import save_weights

    prog = _mxfp4_fixture_program()
    params = prog.load_weights(HF_MXFP4)
    hf = load_file(str(HF_MXFP4 / "model.safetensors"))
    codes, scales = packed_from_hf(hf["model.layers.1.mlp.experts.down_proj_blocks"],
                                   hf["model.layers.1.mlp.experts.down_proj_scales"])
    down = params["layers/moe/experts/down"]
    np.testing.assert_array_equal(np.asarray(down.codes[1]), codes)  # the stored bytes, not a re-encoding
    np.testing.assert_array_equal(np.asarray(down.scales[1]), scales)
    save_weights(params, tmp_path, options=prog.options, graph=prog.graph)
    saved = load_file(str(tmp_path / "model.safetensors"))
    packed_names = [n for n in hf if n.endswith(("_blocks", "_scales"))]
    assert len(packed_names) == 8
    for name in packed_names:
        assert saved[name].dtype == np.uint8 and saved[name].tobytes() == hf[name].tobytes(), name
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    again = prog.load_weights(tmp_path)
    for path, value in params.items():
        for x, y in zip(jax.tree.leaves(value), jax.tree.leaves(again[path])):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), path


def test_a_dense_checkpoint_is_quantised_on_load():
    dense_dir = HF_MXFP4.parent / "gpt_oss"
    params = _mxfp4_fixture_program(dense_dir).load_weights(dense_dir)
    hf = load_file(str(dense_dir / "model.safetensors"))
    down = hf["model.layers.0.mlp.experts.down_proj"]  # [E, F, D], dense
    want = mxfp4.quantize(jnp.asarray(down, jnp.float32))
    got = params["layers/moe/experts/down"]
    np.testing.assert_array_equal(np.asarray(got.codes[0]), np.asarray(want.codes))
    np.testing.assert_array_equal(np.asarray(got.scales[0]), np.asarray(want.scales))


def test_checkpoint_round_trip_of_packed_params(tmp_path, programs):
    from tessera.run.checkpoint import Checkpoints

    packed, _ = programs
    params = packed.init(seed=1)
    ckpt = Checkpoints(tmp_path / "ckpt", keep=1)
    ckpt.save(3, params, {"step": 3})
    ckpt.wait()
    restored, meta = ckpt.restore(3, jax.eval_shape(lambda: params))
    ckpt.close()
    assert meta == {"step": 3} and isinstance(restored["layers/moe/experts/up"], MXFP4)
    for path, value in params.items():
        for x, y in zip(jax.tree.leaves(value), jax.tree.leaves(restored[path])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---- errors a spec can cause ---------------------------------------------------------------------------------

def test_training_packed_parameters_is_refused_at_the_rule(tmp_path):
    spec = write_spec(tmp_path, task=TRAIN)
    with pytest.raises(TesseraError) as err:
        tessera.compile(tessera.load(spec))
    text = str(err.value.diagnostics[0].render())
    line = next(i for i, s in enumerate(spec.read_text().splitlines(), 1) if "rules: {" in s and "mxfp4" in s)
    assert f"{spec}:{line}:" in text or f"{spec.name}:{line}:" in text
    assert "mxfp4 storage is for inference tasks" in text and "layers/moe/experts/gate" in text
    assert "keep the experts in bf16/fp32" in text


def test_a_packed_parameter_needs_groups_of_32(tmp_path):
    spec = write_spec(tmp_path, rules='{"*/moe/experts/*": mxfp4}')  # biases too: [.., experts=8, mlp]
    with pytest.raises(TesseraError, match=r"groups of 32 along a parameter's second-to-last dim; "
                                           r"`layers/moe/experts/down_bias` has `experts` = 8"):
        tessera.compile(tessera.load(spec))


def test_a_mesh_split_that_cuts_scale_groups_is_refused(tmp_path):
    spec = write_spec(tmp_path, mesh="{fsdp: 4}")  # gate [experts, embed=64, mlp]: 16 rows a device, half a group
    with pytest.raises(TesseraError) as err:
        tessera.compile(tessera.load(spec))
    d = err.value.diagnostics[0]
    assert d.key == "mesh.fsdp" and d.span is not None and d.span.line == 6
    assert d.message == ("fsdp=4 splits `embed` = 64 of mxfp4 parameter `layers/moe/experts/gate` into blocks of 16, "
                         "which is not a whole number of 32-element scale groups (2 groups over 4 devices)")
    assert "divides 2: 2" in d.hint


# ---- sharded -------------------------------------------------------------------------------------------------

SHARDED = """
import json, sys
import numpy as np, jax, tessera
from tessera.lower.reference.mxfp4 import MXFP4
out = {}
tokens = np.arange(64).reshape(4, 16) % 64
for name, spec in json.loads(sys.argv[1]).items():
    prog = tessera.compile(tessera.load(spec))
    params = prog.init(seed=0)
    w = params["layers/moe/experts/gate"]
    out[name] = {"logits": np.asarray(prog.forward(params, tokens)).tolist(),
                 "packed": isinstance(w, MXFP4), "codes_local": list(w.codes.addressable_shards[0].data.shape),
                 "codes": int(np.asarray(w.codes, np.int64).sum())}
print("RESULT " + json.dumps(out))
"""


def test_sharded_forward_equals_one_device(tmp_path):
    specs = {"one": str(write_spec(tmp_path)),
             "fsdp2_ep2_tp2": str(write_spec(tmp_path, mesh="{fsdp: 2, ep: 2, tp: 2}"))}
    env = cpu_env(8)
    proc = subprocess.run([sys.executable, "-c", SHARDED, json.dumps(specs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "RESULT " in proc.stdout, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT ", 1)[1])
    one, sharded = res["one"], res["fsdp2_ep2_tp2"]
    assert one["packed"] and sharded["packed"] and one["codes"] == sharded["codes"]  # same bytes, split
    # gate [layers, experts/ep, embed/fsdp, mlp/tp]: codes [2, 8/2, 64/2/2, 64/2] on each device
    assert sharded["codes_local"] == [2, 4, 16, 32] and one["codes_local"] == [2, 8, 32, 64]
    np.testing.assert_allclose(np.asarray(sharded["logits"]), np.asarray(one["logits"]), rtol=1e-5, atol=1e-5)
