"""A moe's d_ff padded in storage so MXFP4 scale groups never straddle devices: which meshes pad and to what,
exactness of the padded program against the unpadded one, GPT-OSS 120B at tp=8 / ep=8, the plan's bytes, and
a Hugging Face load → save round trip with the padding active (byte-identical)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import tessera
from tessera.diagnostics import TesseraError
from tessera.lower import storage
from tessera.lower.options import CompileOptions
from tessera.lower.program import program_graph
from tessera.lower.reference import mxfp4
from tessera.lower.reference.mxfp4 import MXFP4
from tests.cpu_env import cpu_env

pytestmark = pytest.mark.slow  # compiles on 8 devices: scheduled first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
HF_MXFP4 = ROOT / "tests" / "data" / "hf" / "gpt_oss_mxfp4"
SPEC_120B = ROOT / "specs" / "gpt_oss_120b.yaml"
EXPERTS = "layers/moe/experts/"
# d_ff = 96: 3 scale groups, which neither tp=2 nor tp=4 splits whole, so both hold 128
SPEC = """name: tiny_padded
model:
  file: {root}/models/gpt_oss.tsl
  args: {{vocab: 64, d_model: 64, layers: 2, heads: 4, kv_heads: 4, head_dim: 16, experts: 8, top_k: 2,
         d_ff: 96, window: 8}}
mesh: {mesh}
parallel:
  rules: {{batch: [dp, fsdp], embed: fsdp, heads: tp, kv_heads: tp, mlp: tp, vocab: tp, experts: ep}}
  deterministic: false
kernels: reference
numerics:
  default: fp32
  params: fp32
  rules: {{"*/moe/experts/*": mxfp4, "*/moe/experts/*_bias": fp32}}
task: {{kind: forward, tokens: [[1, 2, 3, 4], [5, 6, 7, 8]]}}
"""
MESHES = {"one": "{}", "dp2_ep2_tp2": "{dp: 2, ep: 2, tp: 2}", "ep2_tp4": "{ep: 2, tp: 4}"}


def tiny_spec(tmp_path: Path, mesh: str) -> Path:
    path = tmp_path / f"tiny_{abs(hash(mesh))}.yaml"
    path.write_text(SPEC.format(root=ROOT, mesh=mesh))
    return path


# ---- which meshes pad, and to what (no devices needed: padding reads the spec's mesh) ------------------------

@pytest.mark.parametrize("overrides,held", [
    ({"mesh.tp": 8}, 3072),                        # tp=8: 90 groups → 96 (12 a device)
    ({"mesh.tp": 4, "mesh.dp": 2}, 2944),          # tp=4: 90 groups → 92 (23 a device)
    ({"mesh.tp": 2, "mesh.dp": 4}, None),          # tp=2: 45 groups a device already
    ({"mesh.tp": 1, "mesh.ep": 8}, None),          # ep=8: d_ff is not split
])
def test_the_120b_moe_is_padded_only_where_its_mesh_needs_it(overrides, held):
    exp = tessera.load(SPEC_120B, overrides=overrides)
    graph = program_graph(exp)
    pads = storage.padding(CompileOptions.of(exp), graph)
    if held is None:
        assert pads == {}
    else:  # every param of the moe op with the d_ff dim, packed or not; down_bias [.., embed] has none
        assert pads == {EXPERTS + p: {"mlp": held} for p in ("gate", "gate_bias", "up", "up_bias", "down")}
    types = storage.held_types(CompileOptions.of(exp), graph)
    assert types[EXPERTS + "down"].dims[-2].size == (held or 2880)
    assert types[EXPERTS + "down_bias"] == graph.params[EXPERTS + "down_bias"].type
    assert graph.params[EXPERTS + "down"].type.dim("mlp").size == 2880  # the IR keeps the model's d_ff
    storage.check_packed(CompileOptions.of(exp), graph)  # compiles: no scale group straddles devices any more


def test_padding_does_not_fix_a_split_contraction_over_embed(tmp_path):
    # gate/up contract over embed = 64 (2 groups): fsdp=4 cuts groups there and padding d_ff cannot help
    spec = tiny_spec(tmp_path, "{fsdp: 4, tp: 2}")
    with pytest.raises(TesseraError) as err:
        tessera.compile(tessera.load(spec))
    msgs = [d.message for d in err.value.diagnostics]
    assert all("`embed` = 64" in m and "(2 groups over 4 devices)" in m for m in msgs), msgs
    assert err.value.diagnostics[0].key == "mesh.fsdp" and err.value.diagnostics[0].span.line == 6


def test_resize_pads_with_zero_codes_and_slices_back():
    rng = np.random.default_rng(0)
    w = mxfp4.quantize(jnp.asarray(rng.standard_normal((3, 64, 40)), jnp.float32))
    rows = storage.resize(w, (3, 128, 40))  # K 64 → 128: down's padding
    assert rows.codes.shape == (3, 64, 40) and rows.scales.shape == (3, 4, 40)
    assert np.all(np.asarray(rows.codes[:, 32:]) == 0) and np.all(np.asarray(rows.scales[:, 2:]) == storage.PAD_SCALE)
    dense = np.asarray(mxfp4.dequantize(rows, jnp.float32))
    np.testing.assert_array_equal(dense[:, :64], np.asarray(mxfp4.dequantize(w, jnp.float32)))
    assert np.all(dense[:, 64:] == 0.0) and not np.signbit(dense[:, 64:]).any()  # +0.0
    cols = storage.resize(w, (3, 64, 64))  # N 40 → 64: gate/up's padding
    assert cols.codes.shape == (3, 32, 64) and np.all(np.asarray(cols.codes[..., 40:]) == 0)
    for padded in (rows, cols):
        back = storage.resize(padded, (3, 64, 40))
        assert isinstance(back, MXFP4)
        np.testing.assert_array_equal(np.asarray(back.codes), np.asarray(w.codes))
        np.testing.assert_array_equal(np.asarray(back.scales), np.asarray(w.scales))
    bias = np.ones((2, 96), np.float32)
    grown = storage.resize(bias, (2, 128))
    assert isinstance(grown, np.ndarray) and grown[:, 96:].sum() == 0 and grown[:, :96].sum() == 192


# ---- on 8 CPU devices: exactness, the 120B's held shapes and bytes, HF round trip ------------------------------

SCRIPT = """
import json, sys, tempfile
from pathlib import Path
import numpy as np, jax, jax.numpy as jnp, tessera
from safetensors.numpy import load_file
from tessera.lower.weights import save_weights
from tessera.run.plan import build_plan
from tessera.spec.tasks import ForwardTask

cfg, out = json.loads(sys.argv[1]), {}
E = "layers/moe/experts/"
tokens = np.arange(64).reshape(4, 16) % 64

def shapes(x, sharding):
    return [list(x.shape), list(sharding.shard_shape(x.shape))]  # global, one device's (raises if uneven)

for name, spec in cfg["tiny"].items():
    prog = tessera.compile(tessera.load(spec))
    p = prog.init(seed=0)
    down, gate, gb = p[E + "down"], p[E + "gate"], p[E + "gate_bias"]
    out[name] = {
        "logits": np.asarray(prog.forward(p, tokens)).tolist(),
        "generated": np.asarray(prog.generate(p, tokens[:2, :5], max_new_tokens=6)).tolist(),
        "held": {"down": list(down.shape), "gate": list(gate.shape), "gate_bias": list(gb.shape)},
        "local_down_codes": list(down.codes.addressable_shards[0].data.shape),
        "padding_zero": bool(np.all(np.asarray(down.codes)[:, :, 48:] == 0)
                             and np.all(np.asarray(gate.codes)[..., 96:] == 0)
                             and np.all(np.asarray(gb)[..., 96:] == 0)),
        "true_codes": int(np.asarray(down.codes)[:, :, :48].astype(np.int64).sum()),
    }

for name, over in cfg["big"].items():
    exp = tessera.load(cfg["spec_120b"], overrides=over)
    prog = tessera.compile(exp)
    held = jax.eval_shape(prog.init_fn(), jnp.asarray(0, jnp.uint32))  # abstract: nothing allocated
    sh = prog.plan.param_shardings()
    ours = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(held))
    plan = build_plan(exp, device="h200")
    both = lambda k: [shapes(held[E + k].codes, sh[E + k]), shapes(held[E + k].scales, sh[E + k])]
    out[name] = {"down": both("down"), "gate": both("gate"),
                 "gate_bias": shapes(held[E + "gate_bias"], sh[E + "gate_bias"]), "bytes": ours,
                 "plan_bytes": plan["params"]["bytes"], "plan_total": plan["params"]["total"]}

fixture = json.loads((Path(cfg["hf"]) / "fixture.json").read_text())
base = {f"model.args.{k}": v for k, v in fixture["args"].items()}
base.update({"numerics.rules": {"*/moe/experts/*": "mxfp4", "*/moe/experts/*_bias": "fp32"},
             "parallel.deterministic": False, "kernels": "reference", "task.sample.prompt": [1, 2, 3]})
hf_tokens = np.load(Path(cfg["hf"]) / "tokens.npy")
for name, mesh in {"hf_one": {}, "hf_dp2_ep2_tp2": {"mesh.dp": 2, "mesh.ep": 2, "mesh.tp": 2}}.items():
    exp = tessera.load(cfg["tiny_yaml"], overrides={**base, **mesh})
    prog = tessera.compile(exp.model_copy(update={"task": ForwardTask(kind="forward", tokens=[[1, 2]])}))
    p = prog.load_weights(cfg["hf"])
    d = Path(tempfile.mkdtemp())
    save_weights(p, d, options=prog.options, graph=prog.graph)
    saved, orig = load_file(str(d / "model.safetensors")), load_file(str(Path(cfg["hf"]) / "model.safetensors"))
    again = prog.load_weights(d)
    out[name] = {"down": list(p[E + "down"].shape), "up_bias": list(p[E + "up_bias"].shape),
                 "same_names": sorted(saved) == sorted(orig),
                 "identical": [n for n in orig if n in saved and saved[n].tobytes() == orig[n].tobytes()
                               and saved[n].dtype == orig[n].dtype and saved[n].shape == orig[n].shape],
                 "reload_identical": all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
                                         for k in p for x, y in zip(jax.tree.leaves(p[k]), jax.tree.leaves(again[k]))),
                 "logits": np.asarray(prog.forward(p, hf_tokens)).tolist()}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def device_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("padded")
    cfg = {"tiny": {name: str(tiny_spec(tmp, mesh)) for name, mesh in MESHES.items()},
           "big": {"tp8": {"mesh.tp": 8}, "tp4_dp2": {"mesh.tp": 4, "mesh.dp": 2}, "ep8": {"mesh.tp": 1, "mesh.ep": 8}},
           "spec_120b": str(SPEC_120B), "hf": str(HF_MXFP4), "tiny_yaml": str(ROOT / "specs" / "gpt_oss_tiny.yaml")}
    env = cpu_env(8)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cfg)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "RESULT " in proc.stdout, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


@pytest.mark.parametrize("mesh,local_k", [("dp2_ep2_tp2", 32), ("ep2_tp4", 16)])
def test_padded_program_equals_the_unpadded_one(device_results, mesh, local_k):
    one, padded = device_results["one"], device_results[mesh]
    assert one["held"] == {"down": [2, 8, 96, 64], "gate": [2, 8, 64, 96], "gate_bias": [2, 8, 96]}
    assert padded["held"] == {"down": [2, 8, 128, 64], "gate": [2, 8, 64, 128], "gate_bias": [2, 8, 128]}
    # down codes [layers, experts/ep, 128/2/tp, embed]: whole groups (16 code rows = 32 elements) a device
    assert padded["local_down_codes"] == [2, 4, local_k, 64]
    assert padded["padding_zero"] and padded["true_codes"] == one["true_codes"]  # same draw, zeros after
    # within fp32 rounding: tp reorders the sums
    np.testing.assert_allclose(np.asarray(padded["logits"]), np.asarray(one["logits"]), rtol=1e-5, atol=1e-5)
    assert padded["generated"] == one["generated"]


@pytest.mark.parametrize("name,held", [("tp8", 3072), ("tp4_dp2", 2944), ("ep8", 2880)])
def test_120b_compiles_with_held_shapes_and_plan_bytes(device_results, name, held):
    r = device_results[name]
    tp, ep = {"tp8": (8, 1), "tp4_dp2": (4, 1), "ep8": (1, 8)}[name]
    # down [36, 128, mlp, 2880] as codes [.., mlp/2, ..] and scales [.., mlp/32, ..]; gate [36, 128, 2880, mlp]
    assert r["down"] == [[[36, 128, held // 2, 2880], [36, 128 // ep, held // 2 // tp, 2880]],
                         [[36, 128, held // 32, 2880], [36, 128 // ep, held // 32 // tp, 2880]]]
    assert r["gate"] == [[[36, 128, 1440, held], [36, 128 // ep, 1440, held // tp]],
                         [[36, 128, 90, held], [36, 128 // ep, 90, held // tp]]]
    assert r["gate_bias"] == [[36, 128, held], [36, 128 // ep, held // tp]]
    assert (held // 32 // tp) * tp * 32 == held  # every device holds whole scale groups
    assert r["plan_bytes"] == r["bytes"]  # the plan counts what the program holds, padding included
    assert r["plan_total"] == 116_829_156_672  # parameter counts stay the model's


def test_hf_round_trip_is_byte_identical_with_padding(device_results):
    one, padded = device_results["hf_one"], device_results["hf_dp2_ep2_tp2"]
    assert one["down"] == [2, 4, 32, 32] and padded["down"] == [2, 4, 64, 32]  # d_ff 32 → 64 at tp=2
    assert one["up_bias"] == [2, 4, 32] and padded["up_bias"] == [2, 4, 64]
    original = load_names(HF_MXFP4)
    for r in (one, padded):
        assert r["same_names"] and sorted(r["identical"]) == original and r["reload_identical"]
    # within fp32 rounding: tp reorders the sums
    np.testing.assert_allclose(np.asarray(padded["logits"]), np.asarray(one["logits"]), rtol=1e-5, atol=1e-5)


def load_names(directory: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "np") as f:
        return sorted(f.keys())
