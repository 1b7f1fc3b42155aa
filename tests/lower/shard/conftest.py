"""Sharded runs happen in subprocesses with 8 CPU devices (the rest of the suite keeps its one device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DEVICES = 8


def run_jobs(jobs: list[dict], devices: int = DEVICES) -> list[dict]:
    """Run worker jobs in one fresh interpreter with `devices` host devices; their JSON results."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.lower.shard.worker", json.dumps(jobs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "RESULT " in proc.stdout, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def start_jobs(jobs: list[dict], devices: int = DEVICES) -> subprocess.Popen:
    """Start run_jobs' subprocess without waiting (two models train side by side on two cores)."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", "tests.lower.shard.worker", json.dumps(jobs)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_jobs(proc: subprocess.Popen) -> list[dict]:
    """The results of a started job list."""
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0 and "RESULT " in out, err[-4000:]
    return json.loads(out.split("RESULT ", 1)[1])
