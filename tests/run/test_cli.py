"""`tessera run` / `replay` / `diff` through the command line, with real specs (the fake program stands in for
the compiled model so that these stay fast); manifests are themselves valid specs."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from runfake import cached_program

from tessera.cli import main as cli
from tessera.run import main as run_main
from tessera.spec import load_experiment

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "specs" / "gpt_oss_tiny.yaml")
SMALL = ["task.steps=6", "task.batch=4", "task.seq_len=16", "task.log_every=2", "task.eval_every=0",
         "checkpoint.every=3"]


@pytest.fixture
def fake_compile(monkeypatch):
    monkeypatch.setattr(run_main, "default_compile", cached_program)


def _argv(command, spec, *rest):
    out = [command, spec]
    for s in SMALL:
        out += ["--set", s]
    return out + list(rest)  # later --set wins


def test_run_then_manifest_is_a_valid_spec_and_replays(tmp_path, fake_compile, capsys):
    out = tmp_path / "run"
    assert cli(_argv("run", TINY, "--out", str(out))) == 0
    assert f"manifest: {out / 'manifest.json'}" in capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert m["overrides"] == SMALL and m["status"] == "completed" and len(m["metrics"]) == 6
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True) if shutil.which(
        "git") else None
    if head is not None and head.returncode == 0:  # the spec's repository is recorded where git can read it
        assert m["git"]["commit"] == head.stdout.strip() and isinstance(m["git"]["dirty"], bool)
    (tmp_path / "from_manifest.yaml").write_text(json.dumps(m["spec"]))  # JSON is YAML
    again = load_experiment(tmp_path / "from_manifest.yaml")
    assert again.resolved() == m["spec"] and again.spec_hash == m["spec_hash"]
    assert cli(["replay", str(out / "manifest.json"), "--out", str(tmp_path / "replay")]) == 0
    assert "bit-identical: 6 metric records" in capsys.readouterr().out
    assert cli(["diff", str(out), str(tmp_path / "replay")]) == 0


def test_resume_flag_and_incompatible_spec_is_bad_input(tmp_path, fake_compile, capsys):
    out = tmp_path / "run"
    assert cli(_argv("run", TINY, "--out", str(out), "--set", "task.steps=3")) == 0
    assert cli(_argv("run", TINY, "--out", str(out), "--resume")) == 0
    assert "resuming from checkpoint at step 3" in capsys.readouterr().out
    code = cli(_argv("run", TINY, "--out", str(out), "--set", "task.optimizer.lr=0.1"))
    err = capsys.readouterr().err
    assert code == 2 and "task.optimizer.lr: differs from the checkpoint" in err and "Traceback" not in err


def test_default_run_directory_and_resume_finds_it(tmp_path, fake_compile, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli(_argv("run", TINY, "--set", "task.steps=3")) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    exp = load_experiment(TINY, overrides=SMALL + ["task.steps=3"])
    assert run_dir.name.startswith("gpt_oss_tiny-20") and run_dir.name.endswith("-" + exp.spec_hash[:8])
    assert cli(_argv("run", TINY, "--set", "task.steps=3", "--resume")) == 0
    assert len(list((tmp_path / "runs").iterdir())) == 1  # continued in place


def test_bad_data_file_is_a_plain_error(tmp_path, fake_compile, capsys):
    data = tmp_path / "d.bin"
    data.write_bytes(b"\x01\x02\x03")
    spec = load_experiment(TINY, overrides=SMALL).resolved()
    spec["task"]["data"] = {"kind": "tokens", "path": str(data), "seed": 0}
    (tmp_path / "s.yaml").write_text(json.dumps(spec))
    code = cli(["run", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 1 and f"tessera: error: data file {data}: raw .bin of uint16 tokens must have an even size" in err
