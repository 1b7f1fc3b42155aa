"""Files a spec names count by content: the same spec in another checkout has the same hash and replays."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tessera.diagnostics import RunError
from tessera.run.checkpoint import check_compatible
from tessera.run.replay import relocated_spec
from tessera.spec import load_experiment
from tessera.spec.files import by_content, file_fingerprint, file_records, locate, portable

ROOT = Path(__file__).resolve().parents[2]


def checkout(where: Path) -> Path:
    """A copy of the tiny spec and the model file it names, laid out as in the repository."""
    (where / "specs" / "base").mkdir(parents=True)
    (where / "models").mkdir()
    shutil.copy(ROOT / "specs" / "gpt_oss_tiny.yaml", where / "specs")
    for base in (ROOT / "specs" / "base").iterdir():
        shutil.copy(base, where / "specs" / "base")
    shutil.copy(ROOT / "models" / "gpt_oss.tsl", where / "models")
    return where / "specs" / "gpt_oss_tiny.yaml"


def test_spec_hash_follows_content_not_path(tmp_path):
    a, b = load_experiment(checkout(tmp_path / "a")), load_experiment(checkout(tmp_path / "b"))
    assert a.model.file != b.model.file
    assert a.spec_hash == b.spec_hash
    model = Path(b.model.file)
    model.write_text(model.read_text() + "\n# an edit\n")
    assert load_experiment(tmp_path / "b" / "specs" / "gpt_oss_tiny.yaml").spec_hash != a.spec_hash
    assert portable(a.resolved())["model"]["file"] == "sha256:" + file_fingerprint(a.model.file)


def test_file_records_and_locate_from_another_checkout(tmp_path, monkeypatch):
    exp = load_experiment(checkout(tmp_path / "a"))
    monkeypatch.chdir(tmp_path / "a")
    rec = file_records(exp.resolved())["model.file"]
    assert rec == {"path": str(exp.model.file), "relative": os.path.join("models", "gpt_oss.tsl"),
                   "sha256": file_fingerprint(exp.model.file)}
    checkout(tmp_path / "b")
    shutil.rmtree(tmp_path / "a")  # the original checkout is gone; the relative path finds the copy
    monkeypatch.chdir(tmp_path / "b")
    found, _ = locate(rec)
    assert found == str((tmp_path / "b" / "models" / "gpt_oss.tsl").resolve())
    (tmp_path / "b" / "models" / "gpt_oss.tsl").write_text("different")
    found, tried = locate(rec)
    assert found is None and "models/gpt_oss.tsl (content differs)" in tried and "(missing)" in tried


def test_replay_relocates_files_or_names_what_it_tried(tmp_path, monkeypatch):
    exp = load_experiment(checkout(tmp_path / "a"))
    monkeypatch.chdir(tmp_path / "a")
    manifest = {"spec": exp.resolved(), "files": file_records(exp.resolved())}
    checkout(tmp_path / "b")
    shutil.rmtree(tmp_path / "a")
    monkeypatch.chdir(tmp_path / "b")
    spec = relocated_spec(manifest)
    assert spec["model"]["file"] == str((tmp_path / "b" / "models" / "gpt_oss.tsl").resolve())
    assert {k: v for k, v in spec.items() if k != "model"} == {k: v for k, v in manifest["spec"].items() if k != "model"}
    assert relocated_spec({"spec": {"name": "old"}}) == {"name": "old"}  # manifests from before `files`
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunError, match=r"model\.file: no file holds the content the run used .*\(missing\)"):
        relocated_spec(manifest)


def test_resume_check_compares_files_by_content(tmp_path):
    a, b = load_experiment(checkout(tmp_path / "a")), load_experiment(checkout(tmp_path / "b"))
    saved = file_records(a.resolved())
    check_compatible(b, a.resolved(), b.resolved(), tmp_path, saved)  # moved checkout: same content resumes
    Path(b.model.file).write_text(Path(b.model.file).read_text() + "\n")
    with pytest.raises(Exception, match="model.file"):
        check_compatible(b, a.resolved(), b.resolved(), tmp_path, saved)
    assert by_content({"model": {"file": "/x"}}, None) == {"model": {"file": "/x"}}
