"""The device mesh of an experiment: `mesh:` sizes over the available devices, checked before compiling.

Every failure here is the user's (a mesh that does not fit the devices, an axis that does not divide
the dimension it splits: `tessera.ir.check.check_params_divide`, the check `tessera check` runs) and is a
TesseraError pointing at the spec's `mesh.<axis>` value.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from tessera.diagnostics import Diagnostic, TesseraError
from tessera.ir.check import check_params_divide
from tessera.lower.shard.rules import AxisRules


def _mesh_key(exp, axis: str) -> tuple[str, object]:
    key = f"mesh.{axis}"
    return key, exp.span(key)


def check_devices(exp, n_devices: int, processes: int = 1) -> list[Diagnostic]:
    """The mesh fits the devices: its product at most the device count (the first that many are used), and
    equal to it when several processes share the run (each must hold its part of the mesh)."""
    sizes = exp.mesh.axes
    product = int(np.prod(list(sizes.values())))
    if product == n_devices or (product < n_devices and processes == 1):
        return []
    used = {a: n for a, n in sizes.items() if n > 1} or {"dp": 1}
    axis = max(used, key=lambda a: used[a])
    key, span = _mesh_key(exp, axis)
    shown = " × ".join(f"{a}={n}" for a, n in used.items())
    where = f"{n_devices} are available" if product > n_devices else \
        f"{n_devices} are available over {processes} processes, which must all take part"
    return [Diagnostic(f"the mesh has {product} devices ({shown}) but {where}", span=span, key=key,
                       hint=f"make the product of mesh axes {'at most ' if processes == 1 else ''}{n_devices}, "
                            f"e.g. dp={n_devices}")]


def build_mesh(exp, params, devices=None) -> Mesh:
    """A Mesh over the first exp.mesh.size of `devices` (default: all) with exp.mesh's axes in order pp, dp,
    fsdp, ep, sp, tp. A mesh smaller than the devices present leaves the rest idle (`tessera run` says so)."""
    devices = list(jax.devices() if devices is None else devices)
    processes = jax.process_count()
    rules = AxisRules.from_experiment(exp)
    problems = check_devices(exp, len(devices), processes) + check_params_divide(exp, params, rules)
    if problems:
        raise TesseraError(problems)
    devices = devices[:exp.mesh.size]
    sizes = exp.mesh.axes
    grid = np.asarray(devices, dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes))
