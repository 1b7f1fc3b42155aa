"""Joining a multi-process run: `jax.distributed` from explicit arguments, TESSERA_* or SLURM variables.

    TESSERA_COORDINATOR=host:port TESSERA_NUM_PROCESSES=2 TESSERA_PROCESS_ID=0 tessera run spec.yaml

Every process sees the global device list afterwards, so the mesh spans all hosts; process 0 writes
the manifest, the others log their part under the run directory's `process-<i>/`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from tessera.diagnostics import RunError

ENV = ("TESSERA_COORDINATOR", "TESSERA_NUM_PROCESSES", "TESSERA_PROCESS_ID")


@dataclasses.dataclass(frozen=True)
class Membership:
    """This process's place in the run."""

    coordinator: str | None
    num_processes: int
    process_id: int

    @property
    def is_main(self) -> bool:
        return self.process_id == 0


def membership(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               env: Mapping[str, str] | None = None) -> Membership | None:
    """Who this process is, from the arguments, else TESSERA_*, else SLURM_*; None for a single-process run."""
    env = os.environ if env is None else env
    coordinator = coordinator or env.get("TESSERA_COORDINATOR")
    n = num_processes if num_processes is not None else _int(env, "TESSERA_NUM_PROCESSES")
    pid = process_id if process_id is not None else _int(env, "TESSERA_PROCESS_ID")
    if n is None and "SLURM_NTASKS" in env:  # under srun: one process per task
        n, pid = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID")
    if n is None or n <= 1:
        return None
    if pid is None or not 0 <= pid < n:
        raise RunError(f"process id {pid} is not in 0..{n - 1}; set TESSERA_PROCESS_ID")
    if coordinator is None and "SLURM_NTASKS" not in env:
        raise RunError(f"a run of {n} processes needs a coordinator address: set TESSERA_COORDINATOR=host:port")
    return Membership(coordinator, n, pid)


def _int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise RunError(f"{key}={value!r} is not an integer") from None


_JOINED: list[Membership] = []


def join(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
         env: Mapping[str, str] | None = None) -> Membership | None:
    """Initialize jax.distributed once for this process (CPU collectives through gloo); None when alone."""
    if _JOINED:
        return _JOINED[0]
    who = membership(coordinator, num_processes, process_id, env)
    if who is None:
        return None
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if who.coordinator is None:  # SLURM: jax finds the coordinator and ids itself
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(who.coordinator, who.num_processes, who.process_id)
    _JOINED.append(who)
    return who


def is_main_process() -> bool:
    """Whether this process writes the run's manifest (process 0, or the only one)."""
    return not _JOINED or _JOINED[0].is_main
