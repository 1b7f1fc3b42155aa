"""`replay` re-runs a manifest and is exact about it; `diff` shows spec differences first, then numbers."""

from __future__ import annotations

import json

import pytest
from runfake import FakeExperiment, cached_program

from tessera.run import main as run_main
from tessera.run import replay as run_replay
from tessera.run.replay import compare, diff_command, first_metric_difference, replay_command


@pytest.fixture
def fake_everywhere(monkeypatch):
    """Make the command-level functions load specs and compile programs with the fakes."""
    monkeypatch.setattr(run_replay, "_load_spec_file", FakeExperiment.from_file)
    monkeypatch.setattr(run_main, "default_compile", cached_program)


def test_replay_fresh_run_is_bit_identical_and_tampered_is_not(run_fake, small_spec, tmp_path, fake_everywhere,
                                                               capsys):
    spec = dict(small_spec, task={**small_spec["task"], "steps": 12})
    run_fake(spec, out=tmp_path / "a")
    assert replay_command(str(tmp_path / "a" / "manifest.json"), out=str(tmp_path / "again")) == 0
    assert "bit-identical: 12 metric records" in capsys.readouterr().out
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    m["metrics"][6]["loss"] = m["metrics"][6]["loss"] + 1e-7  # one ulp-scale change at step 7
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(m))
    assert replay_command(str(tmp_path / "a" / "manifest.json"), out=str(tmp_path / "again2")) == 1
    out = capsys.readouterr().out
    assert "metrics first differ at step 7: loss" in out and "params_checksum" not in out
    m["params_checksum"] = "0" * 64
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(m))
    assert replay_command(str(tmp_path / "a"), out=str(tmp_path / "again3")) == 1
    assert "params_checksum 000" in capsys.readouterr().out


def test_diff_spec_first_then_metrics(run_fake, small_spec, tmp_path, capsys):
    spec = dict(small_spec, task={**small_spec["task"], "steps": 6})
    run_fake(spec, out=tmp_path / "a")
    run_fake(spec, out=tmp_path / "b")
    other = json.loads(json.dumps(spec))
    other["task"]["optimizer"]["lr"] = 0.02
    run_fake(other, out=tmp_path / "c")
    assert diff_command(str(tmp_path / "a"), str(tmp_path / "b")) == 0
    assert "identical: 6 metric records" in capsys.readouterr().out
    assert diff_command(str(tmp_path / "a" / "manifest.json"), str(tmp_path / "c" / "manifest.json")) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "spec task.optimizer.lr: 0.01 -> 0.02"
    assert lines[1].startswith("metrics first differ at step ") and lines[2].startswith("params_checksum")


def test_first_metric_difference_edges():
    a = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": float("nan")}]
    assert first_metric_difference(a, [dict(r) for r in a]) is None  # NaN equals NaN here
    assert first_metric_difference(a, a[:1]) == "record count 2 != 1 (first extra step 2)"
    assert first_metric_difference(a, [{"step": 1, "loss": 1.0, "eval_loss": 2.0}]) == "step 1: eval_loss None != 2.0"
    assert compare({"metrics": a, "params_checksum": "x"}, {"metrics": a, "params_checksum": "x"}) == []
