"""A real training process killed (SIGKILL mid-training, SIGKILL during a checkpoint save, Ctrl-C, SIGTERM),
then resumed, ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runfake import train_spec

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

SCRIPT = Path(__file__).with_name("runfake.py")
SPEC = train_spec(steps=40, schedule={"kind": "warmup_cosine", "warmup_steps": 5, "min_lr_ratio": 0.1},
                  sample=None, log_every=5)
SPEC["checkpoint"] = {"dir": "ckpt", "every": 10, "keep": 3}


CACHE: list[str] = []  # one compilation cache for all the processes of this module


def _start(tmp: Path, out: Path, *flags: str) -> subprocess.Popen:
    spec = tmp / "spec.json"
    spec.write_text(json.dumps(SPEC))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cache = ["--cache", CACHE[0]] if CACHE else []
    return subprocess.Popen([sys.executable, str(SCRIPT), str(spec), str(out), *flags, *cache], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _wait_for(pred, timeout: float = 60) -> None:
    end = time.time() + timeout
    while not pred():
        assert time.time() < end, "timed out waiting for the training process"
        time.sleep(0.05)


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _resumes_bit_identical(tmp: Path, out: Path, reference: dict, step: int, *flags: str) -> None:
    """Re-run into `out`; it must resume from `step` and end with the uninterrupted run's numbers."""
    code, log = _finish(_start(tmp, out, *flags))
    assert code == 0, log
    assert f"resuming from checkpoint at step {step}" in log, log
    m = _manifest(out)
    assert m["metrics"] == reference["metrics"]
    assert m["params_checksum"] == reference["params_checksum"]


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("ref")
    CACHE[:] = [str(tmp_path_factory.mktemp("jax-cache"))]
    code, log = _finish(_start(tmp, tmp / "run"))
    assert code == 0, log
    return _manifest(tmp / "run")


def test_sigkill_mid_training_then_resume(tmp_path, reference):
    out = tmp_path / "run"
    proc = _start(tmp_path, out, "--step-sleep", "0.05")
    # past step 25, and step 20's checkpoint committed (saved in the background: on a loaded machine it may
    # still be writing at step 25, and the run then rightly resumes from step 10)
    _wait_for(lambda: _steps_logged(out) >= 25 and (out / "ckpt" / "20").is_dir())
    proc.kill()
    proc.wait()
    m = _manifest(out)  # still a valid manifest, up to the last flushed step: at least the checkpoint's (20)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert m["status"] == "running" and len(m["metrics"]) >= 20 and m["metrics"] == logged[:len(m["metrics"])]
    _resumes_bit_identical(tmp_path, out, reference, 20, "--resume")


def test_sigkill_during_checkpoint_save_keeps_previous(tmp_path, reference):
    out = tmp_path / "run"
    proc = _start(tmp_path, out, "--hang-save", "20")
    marker = Path(f"{out}.saving")  # the checkpoint for step 20 is written but not yet renamed into place
    _wait_for(lambda: marker.exists() or proc.poll() is not None, timeout=120)
    assert proc.poll() is None, proc.communicate()[0]
    proc.kill()
    proc.wait()
    names = sorted(p.name for p in (out / "ckpt").iterdir())
    assert "10" in names and "20" not in names and any(n.startswith("20.") for n in names), names
    _resumes_bit_identical(tmp_path, out, reference, 10)  # re-running into the same --out continues


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])  # Ctrl-C; a scheduler's preemption
def test_interrupt_checkpoints_and_exits_cleanly(tmp_path, reference, sig):
    out = tmp_path / "run"
    proc = _start(tmp_path, out, "--step-sleep", "0.05")
    _wait_for(lambda: _steps_logged(out) >= 15)
    proc.send_signal(sig)
    code, log = _finish(proc)
    assert code == 128 + sig and "Traceback" not in log, log
    assert f"interrupted ({sig.name}): checkpoint at step" in log, log
    m = _manifest(out)
    stopped = m["metrics"][-1]["step"]
    assert m["status"] == "interrupted" and 15 <= stopped < 40
    assert str(stopped) in os.listdir(out / "ckpt")
    _resumes_bit_identical(tmp_path, out, reference, stopped, "--resume")
