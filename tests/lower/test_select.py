"""Kernel selection in the lowering: `kernels: auto|reference`, fallback, and the per-op report."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

import tessera
from tessera.lower import select
from tessera.lower.reference.attention import attention as attention_reference

SPEC = Path(__file__).resolve().parents[2] / "specs" / "gpt_oss_tiny.yaml"
SMALL = {"model.args.d_model": 32, "model.args.heads": 2, "model.args.kv_heads": 1, "model.args.head_dim": 16,
         "model.args.d_ff": 32, "model.args.vocab": 64, "task.sample": None, "task.batch": 2, "task.seq_len": 24}


def _prog(**extra):
    return tessera.compile(tessera.load(SPEC, overrides={**SMALL, **extra}))


def test_report_on_cpu_names_every_attention_and_moe_op():
    report = _prog().kernel_report()
    assert set(report) == {"layers/attention (window 16)", "layers/attention (window None)", "layers/moe experts",
                           "layers/attention (window 16) (decode)", "layers/attention (window None) (decode)"}
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

    monkeypatch.setattr(select, "_allowed", lambda ctx: ctx.kernels == "auto")
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


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_cli_after_lower_prints_the_choices(kernels, capsys):
    from tessera.cli import main

    assert main(["ir", str(SPEC), "--after", "lower", "--set", f"kernels={kernels}"]) == 0
    out = capsys.readouterr().out
    assert "// lowering on backend cpu" in out
    assert "layers/attention (window 16) (decode)" in out
