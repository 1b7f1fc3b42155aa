"""The README's two commands work from a fresh clone: `make test` and `make run` create .venv and run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cpu_env import xla_flags

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_make_test_and_make_run_from_a_fresh_clone(tmp_path):
    if shutil.which("make") is None or shutil.which("git") is None:
        pytest.fail("make and git are needed to check the README's commands")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTEST", "XLA_FLAGS"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)

    test = subprocess.run(["make", "test", "PYTEST_ARGS=tests/spec/test_shipped_specs.py"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert test.returncode == 0, test.stdout[-3000:] + test.stderr[-3000:]
    assert (clone / ".venv" / "bin" / "tessera").exists()
    assert " passed" in test.stdout

    # the suite's quick XLA compile (tests/cpu_env.py), as every other subprocess of the suite runs: the same
    # command, its programs built at LLVM's level 0 (41 s of CPU against 55 at tessera run's own settings)
    run = subprocess.run(["make", "run", "RUN_ARGS=--set task.steps=12 --out runs/smoke"], cwd=clone,
                         env={**env, "XLA_FLAGS": xla_flags(base="")},
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    manifest = clone / "runs" / "smoke" / "manifest.json"
    assert manifest.exists()
    assert str(manifest.relative_to(clone)) in run.stdout + run.stderr
