"""Deterministic mode gives the same bits on any host: a 1-device and an 8-device CPU host run the same
unsharded program to the same parameters (issue 36; the reference is the 1-device host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_env import cpu_env

ROOT = Path(__file__).resolve().parents[2]

# A long contraction with a small result, as a weight gradient is: XLA:CPU's matmul splits it over its
# intra-op threads, and the thread count follows the host (max(PJRT_NPROC or the cores, the devices)).
CONTRACTION = """
import hashlib, sys
from tessera.run.environment import request_deterministic_kernels
if sys.argv[1] == "tessera":
    request_deterministic_kernels(None)  # as `tessera run` does in deterministic mode, before JAX starts
import jax, jax.numpy as jnp, numpy as np
rng = np.random.default_rng(0)
x, dy = (jnp.asarray(rng.standard_normal((2048, 128)), jnp.float32) for _ in range(2))
w = jnp.asarray(rng.standard_normal((4, 128, 128)), jnp.float32)
sizes = jnp.asarray([500, 700, 300, 548], jnp.int32)
dw = jax.jit(jax.grad(lambda w: jnp.vdot(jax.lax.ragged_dot(x, w, sizes), dy)))(w)  # an experts' gradient
dense = jax.jit(lambda a, b: jnp.einsum("mk,mn->kn", a, b))(x, dy)
print("RESULT", hashlib.sha256(np.asarray(dw).tobytes() + np.asarray(dense).tobytes()).hexdigest())
"""


def _contraction(devices: int, mode: str, **env: str) -> subprocess.Popen:
    base = {k: v for k, v in cpu_env(devices, **env).items() if k != "PJRT_NPROC" or "PJRT_NPROC" in env}
    return subprocess.Popen([sys.executable, "-c", CONTRACTION, mode], cwd=ROOT, env=base, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "RESULT " in out, err[-3000:]
    return out.split("RESULT ", 1)[1].strip()


def test_deterministic_matmuls_sum_alike_on_one_and_eight_device_hosts():
    procs = {(d, mode, n): _contraction(d, mode, **({"PJRT_NPROC": n} if n else {}))
             for d, mode, n in [(1, "tessera", None), (8, "tessera", None), (1, "xla", "1"), (8, "xla", "1")]}
    got = {key: _result(p) for key, p in procs.items()}
    assert got[(1, "tessera", None)] == got[(8, "tessera", None)]
    # why the setting is needed: left to XLA, a one-thread host and an eight-device host (eight threads at
    # least) sum the same contraction in different orders
    assert got[(1, "xla", "1")] != got[(8, "xla", "1")]


TINY = ["--set", "task.steps=2", "--set", "task.sample=null", "--set", "task.eval_every=0",
        "--set", "model.args.layers=1", "--set", "checkpoint.every=0"]


@pytest.mark.slow
def test_an_unsharded_run_ends_alike_on_one_and_eight_device_hosts(tmp_path):
    """`tessera run` of the tiny GPT-OSS (its experts' gradients contract 2,048 token copies) on a 1-device and
    an 8-device host: the same parameter checksum after two AdamW steps (Adam's first step hides a gradient's
    last bits behind its sign, the second does not)."""
    procs = {}
    for devices in (1, 8):
        env = {k: v for k, v in cpu_env(devices).items() if k != "PJRT_NPROC"}
        procs[devices] = subprocess.Popen(
            [sys.executable, "-m", "tessera.cli", "run", "specs/gpt_oss_tiny.yaml", *TINY,
             "--out", str(tmp_path / f"host{devices}")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
    records = {}
    for devices, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (out + err)[-3000:]
        records[devices] = json.loads((tmp_path / f"host{devices}" / "manifest.json").read_text())
    assert len(records[8]["devices"]) == 8 and len(records[1]["devices"]) == 1
    assert records[1]["params_checksum"] == records[8]["params_checksum"]
    assert records[1]["pjrt_nproc"] == records[8]["pjrt_nproc"] == "256"
    assert [m["loss"] for m in records[1]["metrics"] if "loss" in m] == \
        [m["loss"] for m in records[8]["metrics"] if "loss" in m]
