"""`tessera plan`: the published GPT-OSS figures through the command, the JSON schema, compile, exit codes."""

import json
import re
import time
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.lower.program import program_graph
from tessera.run import plan_compile
from tessera.spec import load_experiment
from tests.cpu_env import cpu_env

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"
TINY_FORWARD = """name: tiny_forward
model:
  file: {root}/models/llama.tsl
  args: {{vocab: 32, d_model: 16, layers: 2, heads: 2, kv_heads: 1, head_dim: 8, d_ff: 32}}
task: {{kind: forward, tokens: [[1, 2, 3, 4], [5, 6, 7, 8]]}}
"""


def run_json(capsys, *args) -> dict:
    assert main(["plan", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def flat_keys(d: dict, prefix: str = "") -> set[str]:
    """Dotted paths of the leaves (`params.total`, `collectives[].axis`); maps documented whole stay whole."""
    keys = set()
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("bytes_by_dtype", "mesh", "compiler_bytes", "by_param"):
            keys |= flat_keys(v, f"{prefix}{k}.")
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            keys |= flat_keys(v[0], f"{prefix}{k}[].")
        else:
            keys.add(prefix + k)
    return keys


@pytest.fixture
def tiny_forward(tmp_path) -> Path:
    path = tmp_path / "tiny_forward.yaml"
    path.write_text(TINY_FORWARD.format(root=ROOT))
    return path


def test_gpt_oss_120b_on_eight_devices_in_seconds(capsys):
    started = time.perf_counter()
    plan = run_json(capsys, SPECS / "gpt_oss_120b.yaml", "--no-compile", "--device", "h100", "--set", "mesh.tp=8")
    assert time.perf_counter() - started < 20
    p = plan["params"]
    # bytes as held: tp=8 pads the MXFP4 experts' d_ff 2880 → 3072 (60.77 GiB unpadded, docs/contracts.md)
    assert (p["total"], p["active"], round(p["gib"], 2)) == (116_829_156_672, 5_132_639_232, 64.55)
    assert plan["devices"] == 8 and plan["mesh"]["tp"] == 8
    mem = plan["memory_per_device"]
    assert p["bytes"] / 8 < mem["params"] < p["bytes"] / 8 * 1.01  # tp=8 splits all but norms, some biases
    assert mem["gradients"] == mem["optimizer"] == 0 and mem["kv_cache"] > 0
    # generation holds the weights once (split into layers as made): params, KV cache and the working set
    assert mem["total"] == mem["params"] + mem["kv_cache"] + mem["activations"]
    assert plan["device"]["fits"] and plan["device"]["margin_bytes"] == 80e9 - mem["total"]
    assert {c["axis"] for c in plan["collectives"]} == {"tp"}
    assert plan["flops"]["forward_per_token"] == pytest.approx(2 * p["active"], rel=0.01)
    assert plan["compile"]["status"] == "skipped"


def test_gpt_oss_20b(capsys):
    p = run_json(capsys, SPECS / "gpt_oss_20b.yaml", "--no-compile", "--device", "h100")["params"]
    assert (p["total"], p["active"], round(p["gib"], 2)) == (20_914_757_184, 3_608_166_144, 12.82)


def test_json_keys_are_all_documented(capsys, tiny_forward):
    documented = set()
    for row in (ROOT / "docs" / "plan.md").read_text().splitlines():
        if row.startswith("| `"):
            documented |= set(re.findall(r"`([a-z0-9_.\[\]]+)`", row.split("|")[1]))
    for args in [(SPECS / "gpt_oss_120b.yaml", "--no-compile"), (tiny_forward,)]:
        plan = run_json(capsys, *args, "--device", "a100")
        keys = flat_keys(plan)
        assert {"params.active", "memory_per_device.total", "device.fits", "compile.status"} <= keys
        assert {k for k in keys if k not in documented and k + "[]" not in documented} == set()
    assert plan["schema"] == "tessera.plan/1" and plan["compile"]["status"] == "ok"


def test_one_devices_two_shards_free_their_activations_before_the_sum(capsys):
    """C = 2 on one device: the shards run as conditionals' branches and the last one's activations are freed
    before the gradients' fp32 tree sum is written; the plan holds the larger of the two, not both. On a mesh, or
    at C = 4 (the loop), both are counted."""
    two = run_json(capsys, SPECS / "gpt_oss_tiny.yaml", "--no-compile", "--set", "task.batch=2",
                   "--set", "parallel.canonical_shards=2")["memory_per_device"]
    four = run_json(capsys, SPECS / "gpt_oss_tiny.yaml", "--no-compile", "--set", "task.batch=4",
                    "--set", "parallel.canonical_shards=4")["memory_per_device"]
    summed = two["params"]  # fp32 params: their gradients' fp32 sum takes the params' bytes
    assert two["released_before_the_sum"] == -min(two["activations"], summed) < 0
    assert two["total"] == pytest.approx(sum(v for k, v in two.items() if k != "total"))
    assert "released_before_the_sum" not in four


def test_does_not_fit_a_small_device(capsys):
    plan = run_json(capsys, SPECS / "gpt_oss_120b.yaml", "--no-compile", "--device", "l40s", "--set", "mesh.tp=1")
    assert plan["device"]["fits"] is False and plan["device"]["margin_bytes"] < 0


def test_training_memory_and_step_time(capsys):
    plan = run_json(capsys, SPECS / "gpt_oss_tiny.yaml", "--no-compile", "--device", "h100",
                    "--set", "parallel.remat=full")
    mem, f = plan["memory_per_device"], plan["flops"]
    assert mem["params"] == 4 * plan["params"]["total"]             # fp32 master weights
    assert mem["gradients"] == 9 * mem["params"]  # deterministic: a gradient per canonical shard (8 of 16) + their sum
    assert mem["optimizer"] == 2 * mem["params"]                    # adamw mu and nu
    assert f["train_step_hardware_per_token"] > f["train_step_per_token"] > 2 * f["forward_per_token"]
    d = plan["device"]
    assert d["mfu_ceiling"] == pytest.approx(f["train_step_per_token"] / f["train_step_hardware_per_token"])
    tokens = plan["shapes"]["batch"] * plan["shapes"]["seq"]
    assert d["step_time_s"] == pytest.approx(f["train_step_hardware_per_token"] * tokens / 989e12)


@pytest.mark.parametrize("microbatches,per_param", [(1, 1), (4, 2)])
def test_fast_mode_gradients(capsys, microbatches, per_param):
    """Fast mode holds the backward pass's fp32 gradient, plus an fp32 accumulator when microbatches are summed;
    activations are one microbatch's."""
    def plan(m):
        return run_json(capsys, SPECS / "gpt_oss_tiny.yaml", "--no-compile", "--device", "h100", "--set",
                        "parallel.deterministic=false", "--set", f"task.microbatches={m}")["memory_per_device"]

    mem = plan(microbatches)
    assert mem["gradients"] == per_param * mem["params"]
    if microbatches > 1:
        assert mem["activations"] < plan(1)["activations"] / 2


def test_plain_text_when_not_a_terminal(capsys):
    assert main(["plan", str(SPECS / "gpt_oss_20b.yaml"), "--no-compile", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "parameters:" in out and "20,914,757,184" in out and "12.82 GiB" in out
    assert "─" not in out and "\x1b[" not in out  # no table rules, no colour codes


def test_ahead_of_time_compile_beside_ours(capsys, tiny_forward):
    plan = run_json(capsys, tiny_forward, "--device", "cpu")
    c = plan["compile"]
    assert c["status"] == "ok" and c["layers_compiled"] == 2
    figures = c["compiler_bytes"]
    assert figures["total"] == figures["argument"] + figures["output"] - figures["alias"] + figures["temp"]
    assert figures["argument"] >= plan["memory_per_device"]["params"]  # params + tokens
    assert c["ours_bytes"] == plan["memory_per_device"]["total"]


def test_text_plan_shows_the_ahead_of_time_compile(capsys, tiny_forward):
    """The plain-text plan of a spec whose ahead-of-time compile succeeds lists the compiler's figures beside ours
    (it raised a NameError once the compile moved to plan_compile.py: only --json and --no-compile were tested)."""
    assert main(["plan", str(tiny_forward), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "compiler memory" in out and "argument" in out and "ours, same program" in out


def test_plan_of_models_trained_on_loss_entries(capsys):
    """PINNs and the FNO train on their loss entries' inputs, not token batches: the plan counts each entry at the
    task data's sizes (a collocation set's points, the data batch), per sample, and compiles the train step with
    those inputs (a PINN's plan raised KeyError 'points', the FNO's compile failed on 'u0'). L-BFGS's memory of
    differences is in the optimizer's bytes; a collocation model's gradient is one, as held (no canonical shards)."""
    fp32 = ("--set", "numerics.default=fp32", "--set", "numerics.params=fp32")  # fp64 turns x64 on process-wide
    pinn = run_json(capsys, SPECS / "pinn_kovasznay.yaml", "--device", "cpu", *fp32)
    assert pinn["shapes"]["per"] == "sample"
    assert pinn["shapes"]["inputs"] == {"interior": [1000, 2], "boundary": [256, 2], "boundary_target": [256, 3]}
    assert pinn["shapes"]["batch"] == 1000 + 256 and pinn["compile"]["status"] == "ok"
    mem, params = pinn["memory_per_device"], pinn["params"]["bytes"]
    assert mem["gradients"] == params and mem["optimizer"] == (2 + 2 * 100 + 3) * params  # adam, then L-BFGS(100)
    assert mem["activations"] > 0 and pinn["flops"]["train_step_per_token"] > pinn["flops"]["forward_per_token"] > 0
    # without L-BFGS (whose zoom line search evaluates the loss again: not modelled) ours is within 20 % of the
    # compiler's figure; it was 26 % under when a loss entry's several region ops (the network, its derivatives)
    # kept only the last one's layer count
    adam = run_json(capsys, SPECS / "pinn_kovasznay.yaml", "--device", "cpu", *fp32,
                    "--set", "task.optimizer.lbfgs_after=null")
    assert abs(adam["compile"]["ours_bytes"] / adam["compile"]["compiler_bytes"]["total"] - 1) < 0.20
    fno = run_json(capsys, SPECS / "fno_burgers.yaml", "--device", "cpu")
    assert fno["shapes"]["inputs"] == {"u0": [40, 64], "u1": [40, 64]} and fno["compile"]["status"] == "ok"
    assert main(["plan", str(SPECS / "pinn_taylor_green.yaml"), "--no-compile", *fp32]) == 0
    assert "per sample" in capsys.readouterr().out


def test_exit_codes(capsys, tiny_forward, monkeypatch):
    assert main(["plan", str(tiny_forward), "--no-compile", "--device", "h1000"]) == 2
    assert "unknown device `h1000`" in capsys.readouterr().err
    assert main(["plan", str(tiny_forward), "--no-compile", "--set", "mesh.tq=2"]) == 2
    assert "tq" in capsys.readouterr().err
    assert main(["plan", str(tiny_forward) + ".missing", "--no-compile"]) == 2

    def broken(exp, train):
        raise RuntimeError("lowering exploded")

    monkeypatch.setattr(plan_compile, "_lowered", broken)
    assert main(["plan", str(tiny_forward), "--json", "--device", "cpu"]) == 1
    c = json.loads(capsys.readouterr().out)["compile"]
    assert c["status"] == "failed" and "lowering exploded" in c["note"]


def test_sharded_compile_per_device_matches_ours(tmp_path):
    """On 8 (host) devices the sharded program compiles; its argument bytes are our per-device params + tokens."""
    import subprocess
    import sys

    path = tmp_path / "sharded.yaml"
    path.write_text(TINY_FORWARD.format(root=ROOT).replace("heads: 2, kv_heads: 1", "heads: 4, kv_heads: 2")
                    .replace("[5, 6, 7, 8]]", "[5, 6, 7, 8], [1, 2, 3, 4], [5, 6, 7, 8]]")
                    + "mesh: {dp: 2, fsdp: 2, tp: 2}\n")
    env = cpu_env(8)
    proc = subprocess.run([sys.executable, "-m", "tessera.cli", "plan", str(path), "--json", "--device", "cpu"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    c, mem = plan["compile"], plan["memory_per_device"]
    assert c["status"] == "ok" and c["scope"] == "per device, the sharded program"
    tokens = 4 * 4 * 4 // 4  # int32 [4, 4] split over dp x fsdp
    assert c["compiler_bytes"]["argument"] == mem["params"] + tokens
    assert plan["params"]["bytes"] / 4 < mem["params"] < plan["params"]["bytes"] / 3  # norms: fsdp only
    kinds = {(r["axis"], r["kind"], r["what"]) for r in plan["collectives"]}
    assert ("fsdp", "all-gather", "parameters") in kinds and ("tp", "all-reduce", "attention output") in kinds


def _plan_llama_on(*overrides: str) -> dict:
    import subprocess
    import sys

    argv = [sys.executable, "-m", "tessera.cli", "plan", str(SPECS / "llama_tiny.yaml"), "--json", "--device", "cpu"]
    for over in ("task.batch=16", "task.seq_len=16", "model.args.d_model=256", "model.args.d_ff=1024", *overrides):
        argv += ["--set", over]
    proc = subprocess.run(argv, env=cpu_env(8), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_deterministic_training_gathers_per_layer_at_fsdp_memory():
    """Deterministic mode gathers each parameter where its layer reads it (tessera/lower/shard/layerwise.py), and
    sums the gradients into each device's blocks: on fsdp=8 with 8 layers and remat, a device's compiled step holds
    about the whole model's parameters once (26.9 MB against 28.6), where gathering the model whole for the step held
    params, a whole gradient and Adam's moments several times over (103.6 MB). The plan counts it within 10 %."""
    plan = _plan_llama_on("mesh.fsdp=8", "model.args.layers=8", "parallel.remat=dots")
    compiled, whole = plan["compile"]["compiler_bytes"]["total"], plan["params"]["bytes"]
    assert compiled < 1.25 * whole  # params, gradients and two moments of the whole model would be 4x
    assert abs(plan["memory_per_device"]["total"] / compiled - 1) < 0.10


def test_deterministic_training_on_a_mesh_is_planned_as_compiled():
    """Deterministic mode on fsdp=8 without remat: each layer is gathered where it is read and again in the backward
    pass (not kept), and gradients and Adam's moments stay in blocks. The plan counts those (it once counted fsdp=8's
    blocks only, a tenth of what the step compiled to, and said it fit), within 10 % of the compiled step's bytes
    per device."""
    plan = _plan_llama_on("mesh.fsdp=8")
    c, mem = plan["compile"], plan["memory_per_device"]
    assert c["status"] == "ok" and c["scope"] == "per device, the sharded program"
    whole = plan["params"]["bytes"]
    assert mem["params"] > whole  # the held blocks, the tied embedding gathered whole and a gathered layer
    assert mem["optimizer"] == 2 * whole / 8  # Adam's two moments, this device's blocks
    assert abs(mem["total"] / c["compiler_bytes"]["total"] - 1) < 0.10, (mem, c["compiler_bytes"])
    assert c["ours_bytes"] == mem["total"]  # the compile's "ours" counts as the plan does


def test_deterministic_dp_is_planned_as_compiled():
    """dp=8 runs one canonical shard a device, then sums the whole gradients across the devices (`ordered_sum`): four
    gradients at once (the plan counted the shard loop's two, 0.77 of the compiled step)."""
    plan = _plan_llama_on("mesh.dp=8", "model.args.layers=8", "parallel.remat=dots")
    c, mem = plan["compile"], plan["memory_per_device"]
    assert c["status"] == "ok" and mem["gradients"] == 4 * plan["params"]["bytes"]
    assert abs(mem["total"] / c["compiler_bytes"]["total"] - 1) < 0.10, (mem, c["compiler_bytes"])


def test_deterministic_pp_is_planned_as_compiled():
    """Deterministic training on pp=2 x dp=4 with stages of 4 layers: the pipelined step (each stage's layers, the
    other axis a data axis over the canonical shards: tessera/lower/shard/det_pipeline.py) is counted within 10 % of
    the compiled step's bytes per device, its gradient slots included."""
    plan = _plan_llama_on("mesh.pp=2", "mesh.dp=4", "model.args.layers=8", "parallel.remat=dots")
    c, mem = plan["compile"], plan["memory_per_device"]
    assert c["status"] == "ok" and plan["pipeline"] == {"stages": 2, "split_compute": True, "why_not": None}
    assert abs(mem["total"] / c["compiler_bytes"]["total"] - 1) < 0.10, (mem, c["compiler_bytes"])


def test_deterministic_tp_is_planned_as_compiled():
    """parallel.canonical_tp on tp=2 x fsdp=4: tp splits the attention and MLP compute (each device gathers its tp
    slice of a layer over fsdp: tessera/lower/shard/det_tensor.py); counted within 10 % of the compiled step."""
    plan = _plan_llama_on("mesh.tp=2", "mesh.fsdp=4", "model.args.layers=8", "parallel.remat=dots",
                          "parallel.canonical_tp=2")
    c, mem = plan["compile"], plan["memory_per_device"]
    assert c["status"] == "ok" and plan["tensor"] == {"tp": 2, "split_compute": True, "why_not": None}
    assert abs(mem["total"] / c["compiler_bytes"]["total"] - 1) < 0.10, (mem, c["compiler_bytes"])


def test_plan_says_where_deterministic_ep_splits_the_experts(capsys):
    plan = run_json(capsys, SPECS / "gpt_oss_tiny.yaml", "--no-compile", "--set", "mesh.ep=2", "--set", "mesh.dp=4",
                    "--set", "parallel.canonical_ep=2")
    assert plan["experts"] == {"ep": 2, "split_compute": True, "why_not": None} and "tensor" not in plan
    plan = run_json(capsys, SPECS / "gpt_oss_tiny.yaml", "--no-compile", "--set", "mesh.ep=2", "--set", "mesh.dp=4")
    assert plan["experts"]["split_compute"] is False
    assert plan["experts"]["why_not"].startswith("parallel.canonical_ep is not set")
    plan = run_json(capsys, SPECS / "gpt_oss_tiny.yaml", "--no-compile", "--set", "mesh.ep=2", "--set", "mesh.tp=2",
                    "--set", "mesh.dp=2", "--set", "parallel.canonical_ep=2", "--set", "parallel.canonical_tp=2")
    assert plan["experts"] == {"ep": 2, "split_compute": True, "why_not": None}  # both at once
    assert plan["tensor"] == {"tp": 2, "split_compute": True, "why_not": None}


def test_plan_reports_each_parameters_storage_and_compute_type(capsys):
    rules = json.dumps({"*/moe/experts/*": "mxfp4", "*/moe/experts/*_bias": "bf16"})
    plan = run_json(capsys, SPECS / "gpt_oss_20b.yaml", "--no-compile", "--device", "h100", "--set",
                    f"numerics.rules={rules}", "--set", "numerics.default=bf16 @accum(bf16)")
    n = plan["numerics"]
    assert (n["compute"], n["accumulate"], n["loss_scale"]) == ("bf16", "bf16", "none")
    by = n["by_param"]
    assert by["layers/moe/experts/gate"] == {"storage": "mxfp4", "compute": "bf16", "rule": "*/moe/experts/*"}
    assert by["layers/moe/experts/gate_bias"] == {"storage": "bf16", "compute": "bf16", "rule": "*/moe/experts/*_bias"}
    assert by["layers/attention/q"] == {"storage": "bf16", "compute": "bf16", "rule": None}  # params: bf16
    assert by["layers/attn_norm/scale"]["compute"] == by["layers/attention/sinks"]["compute"] == "f32"
    assert main(["plan", str(SPECS / "gpt_oss_20b.yaml"), "--no-compile", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"compute / accumulate\s+bf16 / f32", out)
    assert re.search(r"layers/moe/experts/down\s+mxfp4 -> bf16  \(rule \*/moe/experts/\*\)", out)


def test_the_manifest_records_the_plans_numerics(capsys):
    from tessera.lower.program import compile_experiment
    from tessera.spec import load_experiment

    over = ["numerics.default=fp16 @loss_scale(dynamic)", 'numerics.rules={"*/experts/gate": "bf16"}']
    plan = run_json(capsys, SPECS / "gpt_oss_tiny.yaml", "--no-compile", "--device", "h100",
                    *[a for o in over for a in ("--set", o)])
    recorded = compile_experiment(load_experiment(SPECS / "gpt_oss_tiny.yaml", overrides=over)).numerics_report()
    assert recorded == plan["numerics"]  # what tessera run writes under the manifest's `numerics`
    assert recorded["loss_scale"] == "dynamic" and recorded["compute"] == "f16"
    assert recorded["by_param"]["layers/moe/experts/gate"]["storage"] == "bf16"


@pytest.mark.parametrize("over, copies", [
    (["parallel.deterministic=false"], 1),             # the layers' scan holds one copy
    (["task.batch=8"], 4),      # deterministic, 8 shards: both layouts held, layers unrolled, the copies split
    (["task.batch=8", "numerics.default=fp8_e4m3 @scale(delayed(4)) @accum(fp32)"], 2),  # delayed: scanned
    (["numerics.default=bf16 @accum(fp32)"], 0),
])
def test_the_plan_counts_the_held_fp8_weight_copies(capsys, over, copies):
    """One byte for each weight of the layers' fp8 products (q, k, v, o, gate, up, down of llama_tiny's two layers),
    per copy the step holds (tessera/lower/fp8_held.py); none without fp8 products."""
    plan = run_json(capsys, SPECS / "llama_tiny.yaml", "--no-compile", "--set",
                    "numerics.default=fp8_e4m3 @scale(per_tensor) @accum(fp32)", *(a for o in over for a in ("--set", o)))
    fp8 = {path: p["storage"] for path, p in plan["numerics"]["by_param"].items() if p["compute"] == "fp8_e4m3"}
    assert len(fp8) == (7 if copies else 0)
    graph = program_graph(load_experiment(SPECS / "llama_tiny.yaml"))
    weights = sum(graph.params[p].type.numel() for p in fp8)
    assert plan["memory_per_device"].get("fp8_weight_copies", 0) == copies * weights
