"""`mesh: auto`: the mesh a run takes, chosen from the devices present and `tessera plan`'s memory model.

The rule: the fewest model-parallel devices whose per-device plan fits the usable memory, then as many
data-parallel replicas of that as the task's batch divides and the devices allow. Model parallelism is
tensor parallelism first (it splits every layer, so it cuts the memory of all of them), then expert
parallelism for mixtures of experts whose heads do not divide. A mesh that the spec checks refuse (a
head count the axis does not divide, a batch the replicas do not split) is passed over, not tried.

    choice = choose_mesh(exp, devices=8, memory=0.95 * 80e9)
    choice.exp          # exp on the chosen axes (mesh.auto still true): what the run and its manifest use
    choice.reason       # one line for the person running it
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tessera.diagnostics import RunError, TesseraError
from tessera.ir.check import divisors

MODEL_AXES = ("tp", "ep")  # tried in this order at each model-parallel size


@dataclasses.dataclass(frozen=True)
class MeshChoice:
    """The experiment on its chosen mesh, why, and the plan's per-device bytes there."""

    exp: Any
    reason: str
    planned_bytes: float
    usable_bytes: float
    devices: int

    def record(self) -> dict:
        """What the manifest keeps under `mesh_choice`."""
        return {"auto": True, "mesh": {a: n for a, n in self.exp.mesh.axes.items() if n > 1} or {"devices": 1},
                "devices_present": self.devices, "planned_bytes_per_device": self.planned_bytes,
                "usable_bytes_per_device": self.usable_bytes, "reason": self.reason}


def _batch(exp) -> int:
    """The rows one step holds: the task's batch, or a generate task's largest group of equal-length prompts."""
    task = exp.task
    if task.kind == "generate":
        lengths = [len(p) for p in task.prompts]
        return max(lengths.count(n) for n in set(lengths))
    return int(getattr(task, "batch", 1) or 1)


def _on(exp, **axes):
    """exp on an explicit mesh of `axes` (validated again, so the spec checks apply to it)."""
    from tessera.spec.checks import run_checks

    mesh = exp.mesh.model_copy(update={"pp": 1, "dp": 1, "fsdp": 1, "ep": 1, "sp": 1, "tp": 1, **axes,
                                       "auto": True})  # chosen: these axes, the other devices idle
    candidate = exp.model_copy(update={"mesh": mesh})
    return candidate if not run_checks(candidate) else None


def _planned(exp) -> float | None:
    """The plan's per-device total for exp, None when the plan refuses the layout."""
    from tessera.run.plan import build_plan

    try:
        return float(build_plan(exp, "cpu")["memory_per_device"]["total"])  # memory does not depend on the device
    except TesseraError:
        return None


def choose_mesh(exp, devices: int, memory: float) -> MeshChoice:
    """exp on the mesh `mesh: auto` picks among `devices` devices of `memory` usable bytes each; RunError when
    no mesh fits (the message gives the smallest plan found)."""
    best: tuple[float, str] | None = None
    for m in divisors(devices):
        for axis in MODEL_AXES if m > 1 else ("tp",):
            model = _on(exp, **{axis: m})
            if model is None:
                continue
            planned = _planned(model)
            if planned is None:
                continue
            if best is None or planned < best[0]:
                best = (planned, f"{axis}={m}")
            if planned > memory:
                continue
            rows, rest = _batch(exp), devices // m
            dp = max(d for d in divisors(rest) if rows % d == 0 and _on(exp, **{axis: m, "dp": d}) is not None)
            chosen = _on(exp, **{axis: m, "dp": dp})
            planned = _planned(chosen) or planned
            why = (f"fewest model-parallel devices that fit: {axis}={m}" if m > 1 else
                   "the model fits on one device") + f" ({_gib(planned)} planned of {_gib(memory)} usable)"
            if dp > 1:
                why += f"; dp={dp} replicas over the rest"
            idle = devices - m * dp
            if idle:
                why += f"; {idle} of {devices} devices idle (the batch of {rows} splits no further)"
            return MeshChoice(chosen, why, planned, memory, devices)
    smallest = f"; the smallest plan is {_gib(best[0])} per device with {best[1]}" if best else ""
    raise RunError(f"mesh: auto found no mesh of {devices} device(s) with {_gib(memory)} usable each that holds "
                   f"{exp.name}{smallest}; use more devices, a smaller task.batch, or remat")


def _gib(b: float) -> str:
    return f"{b / 2 ** 30:,.1f} GiB"


def usable_memory() -> tuple[float, int, str]:
    """(usable bytes per device, device count, the device's name) on this machine: what JAX's allocator may
    take on an accelerator (its `bytes_limit`), the physical memory on a CPU."""
    import jax

    from tessera.run.manifest import device_memory
    from tessera.run.plan import cpu_device

    limit = (device_memory() or {}).get("bytes_limit")
    return limit or cpu_device().memory, len(jax.devices()), jax.local_devices()[0].device_kind
