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


def check_devices(exp, n_devices: int) -> list[Diagnostic]:
    """The mesh's product equals the device count."""
    sizes = exp.mesh.axes
    product = int(np.prod(list(sizes.values())))
    if product == n_devices:
        return []
    used = {a: n for a, n in sizes.items() if n > 1} or {"dp": 1}
    axis = max(used, key=lambda a: used[a])
    key, span = _mesh_key(exp, axis)
    shown = " × ".join(f"{a}={n}" for a, n in used.items())
    return [Diagnostic(f"the mesh has {product} devices ({shown}) but {n_devices} are available", span=span, key=key,
                       hint=f"make the product of mesh axes {n_devices}, e.g. dp={n_devices}")]


def build_mesh(exp, params, devices=None) -> Mesh:
    """A Mesh over `devices` (default: all) with exp.mesh's axes in order pp, dp, fsdp, ep, sp, tp."""
    devices = list(jax.devices() if devices is None else devices)
    if exp.mesh.auto:  # `mesh: auto` chose these axes and may leave devices idle (a batch that splits no further)
        devices = devices[:exp.mesh.size]
    rules = AxisRules.from_experiment(exp)
    problems = check_devices(exp, len(devices)) + check_params_divide(exp, params, rules)
    if problems:
        raise TesseraError(problems)
    sizes = exp.mesh.axes
    grid = np.asarray(devices, dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes))
