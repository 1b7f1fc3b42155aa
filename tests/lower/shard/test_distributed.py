"""Multi-process runs: joining from the environment, and 2 processes × 4 CPU devices == 1 process × 8."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tessera.diagnostics import RunError
from tessera.run.distributed import membership
from tests.lower.shard.conftest import ROOT, run_jobs
from tests.cpu_env import cpu_env

pytestmark = pytest.mark.slow  # compiles on 8 devices: scheduled first (tests/conftest.py)


def test_membership_from_tessera_env_and_slurm():
    assert membership(env={}) is None
    who = membership(env={"TESSERA_COORDINATOR": "h:1", "TESSERA_NUM_PROCESSES": "2", "TESSERA_PROCESS_ID": "1"})
    assert (who.coordinator, who.num_processes, who.process_id, who.is_main) == ("h:1", 2, 1, False)
    slurm = membership(env={"SLURM_NTASKS": "4", "SLURM_PROCID": "0"})
    assert (slurm.coordinator, slurm.num_processes, slurm.is_main) == (None, 4, True)
    assert membership(num_processes=2, process_id=0, coordinator="x:2", env={}).is_main


@pytest.mark.parametrize("env,message", [
    ({"TESSERA_NUM_PROCESSES": "2", "TESSERA_PROCESS_ID": "0"}, "needs a coordinator address"),
    ({"TESSERA_COORDINATOR": "h:1", "TESSERA_NUM_PROCESSES": "2", "TESSERA_PROCESS_ID": "2"}, "not in 0..1"),
    ({"TESSERA_NUM_PROCESSES": "two"}, "is not an integer"),
])
def test_membership_errors(env, message):
    with pytest.raises(RunError, match=message):
        membership(env=env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


JOBS = [{"kind": "train", "spec": "specs/llama_tiny.yaml", "steps": 2,
         "overrides": {"parallel.deterministic": True, "mesh.tp": 2, "mesh.dp": 4}}]


def test_two_processes_of_four_devices_equal_one_process_of_eight():
    port = _free_port()
    procs = []
    for pid in range(2):
        env = cpu_env(4, TESSERA_COORDINATOR=f"127.0.0.1:{port}", TESSERA_NUM_PROCESSES="2", TESSERA_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.lower.shard.worker", json.dumps(JOBS)], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:] + outs[1][1][-3000:]
    assert "RESULT " in outs[0][0] and "RESULT " not in outs[1][0]  # process 0 reports
    multi = json.loads(outs[0][0].split("RESULT ", 1)[1])[0]
    single = run_jobs(JOBS)[0]
    assert multi["losses"] == single["losses"] and multi["checksum"] == single["checksum"]
