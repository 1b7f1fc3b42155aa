"""Every shipped spec validates, has the numbers the model cards give, and `tessera check` accepts it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tessera import cli
from tessera.spec import load_experiment, summary

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
BASES = sorted((ROOT / "specs" / "base").glob("*.yaml"))

GPT_OSS_120B = dict(vocab=201088, d_model=2880, layers=36, heads=64, kv_heads=8, head_dim=64, experts=128, top_k=4,
                    d_ff=2880, window=128, rope_theta=150000, rope_factor=32, rope_original=4096, rope_beta_fast=32,
                    rope_beta_slow=1, swiglu_alpha=1.702, swiglu_limit=7.0, norm_eps=1e-5)
LLAMA_ARGS = {"vocab", "d_model", "layers", "heads", "kv_heads", "head_dim", "d_ff", "rope_theta", "norm_eps",
              "tie_embeddings"}


def test_the_four_specs_are_shipped() -> None:
    names = {p.name for p in SPECS}
    assert {"gpt_oss_120b.yaml", "gpt_oss_20b.yaml", "gpt_oss_tiny.yaml", "llama_tiny.yaml"} <= names
    assert [p.name for p in BASES] == ["gpt_oss.yaml"]


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_spec_validates(path: Path, tmp_path: Path) -> None:
    exp = load_experiment(path)
    assert exp.name == path.stem and exp.model.file.is_file()
    assert summary(exp).startswith(f"{exp.name}: ok")
    again = tmp_path / "resolved.yaml"  # the resolved spec is itself a valid spec, wherever it lies
    again.write_text(exp.to_yaml())
    assert load_experiment(again).resolved() == exp.resolved()


def test_gpt_oss_120b() -> None:
    exp = load_experiment(ROOT / "specs" / "gpt_oss_120b.yaml")
    assert exp.model.args == GPT_OSS_120B and exp.model.file.name == "gpt_oss.tsl"
    assert exp.mesh.auto and exp.mesh.size == 1  # `tessera run` picks the mesh from the devices present
    assert str(exp.numerics.default) == "bf16 @accum(fp32)" and str(exp.numerics.params) == "bf16"
    assert {k: str(v) for k, v in exp.numerics.rules.items()} == {"*/moe/experts/*": "mxfp4",
                                                                   "*/moe/experts/*_bias": "bf16"}
    assert list(exp.numerics.rules) == ["*/moe/experts/*", "*/moe/experts/*_bias"]  # order matters: last wins
    assert str(exp.numerics.match("layers/moe/experts/gate")) == "mxfp4"
    assert str(exp.numerics.match("layers/moe/experts/gate_bias")) == "bf16"
    assert exp.numerics.match("layers/attention/q") is None
    assert exp.task.kind == "generate"


def test_gpt_oss_20b() -> None:
    exp = load_experiment(ROOT / "specs" / "gpt_oss_20b.yaml")
    assert exp.model.args == {**GPT_OSS_120B, "layers": 24, "experts": 32}
    assert exp.mesh.size == 1 and exp.task.kind == "generate"
    assert str(exp.numerics.rules["*/moe/experts/*"]) == "mxfp4"


@pytest.mark.parametrize("stem", ["gpt_oss_tiny", "llama_tiny"])
def test_tiny_specs_train_on_bytes(stem: str) -> None:
    exp = load_experiment(ROOT / "specs" / f"{stem}.yaml")
    assert exp.task.kind == "train" and exp.model.args["vocab"] == 256 and exp.mesh.size == 1
    assert str(exp.numerics.default) == "fp32" and exp.numerics.rules == {}
    assert exp.task.steps <= 200 and exp.task.sample is not None
    if stem == "llama_tiny":
        assert set(exp.model.args) == LLAMA_ARGS
    else:
        assert set(exp.model.args) == set(GPT_OSS_120B)


def test_check_prints_summary(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["check", str(ROOT / "specs" / "gpt_oss_tiny.yaml"), "--set", "task.steps=7"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpt_oss_tiny: ok (spec ") and "train 7 steps" in out


def test_check_print_resolved(capsys: pytest.CaptureFixture) -> None:
    path = ROOT / "specs" / "gpt_oss_120b.yaml"
    assert cli.main(["check", str(path), "--print-resolved", "--set", "mesh.tp=4"]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)
    assert data["mesh"]["tp"] == 4 and data["task"]["sampling"]["top_p"] == 1.0 and "extends" not in data
    assert out == load_experiment(path, overrides={"mesh.tp": 4}).to_yaml()
