"""Sharded runs happen in subprocesses with 8 CPU devices (the rest of the suite keeps its one device)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from tests.cpu_env import cpu_env

ROOT = Path(__file__).resolve().parents[3]
DEVICES = 8


def run_jobs(jobs: list[dict], devices: int = DEVICES, **env_vars: str) -> list[dict]:
    """Run worker jobs in one fresh interpreter with `devices` host devices (and `env_vars` set, XLA_FLAGS
    included: they replace the suite's); their JSON results."""
    env = cpu_env(devices, **env_vars)
    proc = subprocess.run([sys.executable, "-m", "tests.lower.shard.worker", json.dumps(jobs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "RESULT " in proc.stdout, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def start_jobs(jobs: list[dict], devices: int = DEVICES) -> subprocess.Popen:
    """Start run_jobs' subprocess without waiting (two models train side by side on two cores)."""
    env = cpu_env(devices)
    return subprocess.Popen([sys.executable, "-m", "tests.lower.shard.worker", json.dumps(jobs)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_jobs(proc: subprocess.Popen) -> list[dict]:
    """The results of a started job list."""
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0 and "RESULT " in out, err[-4000:]
    return json.loads(out.split("RESULT ", 1)[1])


# Two AdamW steps from the same init, gradients reduced in another order. A bias's gradient is a sum over every
# token of terms that mostly cancel, so its last bits differ from mesh to mesh, and Adam divides each gradient
# by its own RMS: the trained tensor moves by up to ~2e-4 of its norm (seen: q_bias and router_bias under sp).
# A missing or doubled reduction changes a tensor's update by the order of the update itself, and in two steps
# every tensor here moves by more than 1e-2 of its norm (the weights ~15 %, the zero-initialised biases 100 %).
TRAINED_RTOL = 1e-3


def assert_trained_close(got: dict, ref: dict, rtol: float = TRAINED_RTOL) -> None:
    """Each trained tensor (a list of floats per path) within rtol of the reference, relative to its norm."""
    import numpy as np

    assert got.keys() == ref.keys()
    for path, values in ref.items():
        a, b = np.asarray(got[path]), np.asarray(values)
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b) + 1e-9, path
