"""Kernels chosen through the lowering table: `kernels: auto|reference`, fallback, and the per-op report."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

import tessera
from tessera.lower import table
from tessera.lower.reference.attention import attention as attention_reference
from tests.cpu_env import cpu_env

SPEC = Path(__file__).resolve().parents[2] / "specs" / "gpt_oss_tiny.yaml"
SMALL = {"model.args.d_model": 32, "model.args.heads": 2, "model.args.kv_heads": 1, "model.args.head_dim": 16,
         "model.args.d_ff": 32, "model.args.vocab": 64, "task.sample": None, "task.batch": 2, "task.seq_len": 24}


def _prog(**extra):
    return tessera.compile(tessera.load(SPEC, overrides={**SMALL, **extra}))


def _gpu_kernels_on_the_cpu(monkeypatch):
    """The table's GPU kernels registered for the CPU backend too (the test patches what they call)."""
    kernels = table._table()[1]
    for (prim, backend), entries in list(kernels.items()):
        if backend == "gpu":
            monkeypatch.setitem(kernels, (prim, "cpu"), entries)


def test_report_on_cpu_names_every_attention_and_moe_op():
    report = _prog().kernel_report()
    assert set(report) == {"layers/attention (window 16)", "layers/attention (window None)", "layers/moe experts",
                           "layers/attention (window 16) (decode)", "layers/attention (window None) (decode)",
                           "layers/moe experts (decode)", "layers/moe routing (decode)"}
    assert all(choice == "reference (jax.numpy): no kernel for backend cpu" for choice in report.values())


def test_kernels_reference_is_obeyed():
    report = _prog(kernels="reference").kernel_report()
    assert all(choice.endswith("kernels = reference") for choice in report.values())


def test_auto_takes_the_kernel_where_supported_and_computes_the_same(monkeypatch):
    from tessera.lower.kernels import flash_attention as fa
    from tessera.lower.kernels import grouped_matmul as gm

    reference = _prog(kernels="reference")
    params = reference.init(0)
    tokens = np.random.default_rng(0).integers(0, 64, (2, 24)).astype(np.int32)
    expected = np.asarray(reference.forward(params, tokens))

    calls = {"attention": 0, "grouped": 0}

    def fake_flash(q, k, v, **kw):  # stands in for the GPU kernel: same semantics, counted
        calls["attention"] += 1
        return attention_reference(q, k, v, **kw)

    def fake_grouped(lhs, rhs, group_sizes):
        calls["grouped"] += 1
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)

    _gpu_kernels_on_the_cpu(monkeypatch)
    monkeypatch.setattr(fa, "supported", lambda *a, **k: True)
    monkeypatch.setattr(fa, "flash_attention", fake_flash)
    monkeypatch.setattr(gm, "supported", lambda *a, **k: True)
    monkeypatch.setattr(gm, "grouped_matmul", fake_grouped)
    auto = _prog(kernels="auto")
    np.testing.assert_allclose(np.asarray(auto.forward(params, tokens)), expected, rtol=1e-6, atol=1e-6)
    # traced once per layer of the unrolled period (2): one attention, and gate, up, down in each MoE
    assert calls["attention"] == 2 and calls["grouped"] == 6
    report = auto.kernel_report()
    assert report["layers/attention (window 16)"] == "flash_attention (Pallas, Mosaic GPU)"
    assert report["layers/moe experts"] == "grouped_matmul (Pallas, Mosaic GPU)"


def _generation_against_the_reference(overrides: dict, seed: int):
    """(compile_(kernels) of the small spec with `overrides` as an inference task, its reference program's params,
    2 prompts of 5 tokens, the reference's 4 new tokens for them)."""
    from tessera.spec.tasks import ForwardTask

    forward = ForwardTask(kind="forward", tokens=[[1, 2]])  # packed experts are for inference tasks
    compile_ = lambda kernels: tessera.compile(  # noqa: E731
        tessera.load(SPEC, overrides={**SMALL, **overrides, "kernels": kernels}).model_copy(update={"task": forward}))
    reference = compile_("reference")
    params = reference.init(0)
    prompts = np.random.default_rng(seed).integers(0, 64, (2, 5)).astype(np.int32)
    return compile_, params, prompts, np.asarray(reference.generate(params, prompts, max_new_tokens=4))


def test_decode_multiplies_unsorted_pairs_by_packed_experts(monkeypatch):
    """Decoding a packed-expert model takes the pairs kernel (no sort) and generates what the reference does."""
    from tessera.lower.kernels import mxfp4_matmul as mk
    from tessera.lower.kernels import moe_pairs
    from tessera.lower.reference import moe

    rules = {"numerics.rules": {"*/moe/experts/*": "mxfp4", "*/moe/experts/*_bias": "fp32"}}
    compile_, params, prompts, expected = _generation_against_the_reference(rules, seed=1)
    calls = []

    def fake_pairs(x, weights, experts, **kw):  # stands in for the GPU kernels: same semantics, counted
        calls.append(experts.shape)
        return moe.pairs_ffn(x, weights, experts, **kw)

    _gpu_kernels_on_the_cpu(monkeypatch)
    monkeypatch.setattr(mk, "supported", lambda *a, **k: False)  # prefill: the reference ragged_dot
    monkeypatch.setattr(moe_pairs, "supported", lambda *a, **k: True)
    monkeypatch.setattr(moe_pairs, "pairs_ffn", fake_pairs)
    auto = compile_("auto")
    np.testing.assert_array_equal(np.asarray(auto.generate(params, prompts, max_new_tokens=4)), expected)
    assert calls and all(shape == (2, 2) for shape in calls)  # batch 2 x top-2: a row of experts a token
    assert auto.kernel_report()["layers/moe experts (decode)"].startswith("mxfp4_pair_gemv and its epilogues")


def test_decode_routes_with_the_routing_kernel(monkeypatch):
    """A decode step's routing goes through the routing kernel (here its interpreted self) where it is supported,
    in the sorted MoE too (batch 2 x top-2 is more than the pairs path takes), and generates what the reference
    does; prefill keeps the reference (the report names only the decode op)."""
    from tessera.lower.kernels import moe_route

    compile_, params, prompts, expected = _generation_against_the_reference({}, seed=2)
    calls = []
    interpreted = moe_route.route_blocks

    def counted(blocks, bias, top_k, config=None):
        calls.append(blocks.shape)
        return interpreted(blocks, bias, top_k, config=moe_route.RouteConfig(interpret=True))

    _gpu_kernels_on_the_cpu(monkeypatch)
    monkeypatch.setattr(moe_route, "supported", lambda *a, **k: True)
    monkeypatch.setattr(moe_route, "route_blocks", counted)
    auto = compile_("auto")
    np.testing.assert_array_equal(np.asarray(auto.generate(params, prompts, max_new_tokens=4)), expected)
    assert calls and all(shape[0] == 2 for shape in calls)  # one token a row, two rows
    report = auto.kernel_report()
    assert report["layers/moe routing (decode)"] == "moe_route (Pallas, Triton)"
    assert not any(k.startswith("layers/moe routing") and "(decode)" not in k for k in report)


def test_sharded_steps_take_only_kernels_verified_inside_shard_map(monkeypatch):
    from tessera.lower.context import LowerCtx

    import dataclasses

    kernels = table._table()[1]
    for key, entries in list(kernels.items()):  # every kernel not (yet) verified there
        monkeypatch.setitem(kernels, key, [dataclasses.replace(k, in_shard_map=False) for k in entries])
    gpu = LowerCtx(kernels="auto", backend="gpu", shard=object())
    report = {}
    qkv = [np.ones((1, 4, 2, 8), np.float32)] * 3
    core = dict(sinks=None, causal=True, window=None, scale=0.5)
    out = table.dispatch(gpu.replace(report=report), "attention", "attn", *qkv, **core)
    assert out.shape == (1, 4, 2, 8)
    unverified = "not yet verified inside the sharded step (shard_map with check_vma)"
    assert report == {"attn": f"reference (jax.numpy): flash_attention {unverified}"}
    # one device, and generation (no check_vma), ask the kernel itself: here, on the CPU, it declines
    for ctx in (gpu.replace(shard=None), gpu.replace(mode="prefill")):
        assert table.choose(ctx, "attention", *qkv, **core)[0] == \
            "reference (jax.numpy): shapes or dtypes outside flash_attention"
    kernels[("attention", "gpu")] = [dataclasses.replace(k, in_shard_map=True) for k in kernels[("attention", "gpu")]]
    assert unverified not in table.choose(gpu, "attention", *qkv, **core)[0]


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_cli_after_lower_prints_the_choices(kernels, capsys):
    from tessera.cli import main

    assert main(["ir", str(SPEC), "--after", "lower", "--set", f"kernels={kernels}"]) == 0
    out = capsys.readouterr().out
    assert "// lowering on backend cpu" in out
    assert "layers/attention (window 16) (decode)" in out


@pytest.mark.parametrize("spec", ["pinn_kovasznay.yaml", "fno_burgers.yaml"])
def test_cli_after_lower_of_models_on_loss_entries(spec, capsys):
    """A PINN's and the FNO's inputs are points and fields, not token ids: the kernel report traces the forward
    pass with the input the model declares (a PINN's ended in a traceback: an int32 [batch, seq] given for its
    [points, coord] floats), and no decoding step."""
    from tessera.cli import main

    fp32 = ["--set", "numerics.default=fp32", "--set", "numerics.params=fp32"]  # fp64 turns x64 on process-wide
    assert main(["ir", str(SPEC.parent / spec), "--after", "lower", *fp32]) == 0
    out = capsys.readouterr().out
    assert "// lowering on backend cpu" in out and "(decode)" not in out


def test_report_of_a_sharded_fast_program_traces_the_sharded_step():
    """kernel_report follows the sharded step: on a (pretend) GPU mesh its train/forward ops say why not."""
    import json
    import subprocess
    import sys

    code = f"""
import json, jax
import tessera
jax.default_backend = lambda: "gpu"   # choose as on a GPU; the kernels' own supported() still sees the CPU
import dataclasses
from tessera.lower import table
kernels = table._table()[1]
for key, entries in list(kernels.items()):  # as for kernels not (yet) verified inside shard_map
    kernels[key] = [dataclasses.replace(k, in_shard_map=False) for k in entries]
prog = tessera.compile(tessera.load({str(SPEC)!r}, overrides={{**{SMALL!r}, "mesh.dp": 2,
                       "parallel.deterministic": False, "kernels": "auto"}}))
print("REPORT", json.dumps(prog.kernel_report()))
"""
    env = cpu_env(2)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.split("REPORT ", 1)[1])
    why = "not yet verified inside the sharded step (shard_map with check_vma)"
    assert report["layers/attention (window 16)"].endswith("flash_attention " + why)
    assert report["layers/moe experts"].endswith("mxfp4_ragged_dot / grouped_matmul " + why)
    assert "decode_attention" in report["layers/attention (window 16) (decode)"]  # generation: one-device choice
