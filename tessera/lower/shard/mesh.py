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
from tessera.lower.options import CompileOptions


def check_devices(options: CompileOptions, n_devices: int, processes: int = 1) -> list[Diagnostic]:
    """The mesh fits the devices: its product at most the device count (the first that many are used), and
    equal to it when several processes share the run (each must hold its part of the mesh)."""
    sizes = options.mesh_axes
    product = int(np.prod(list(sizes.values())))
    if product == n_devices or (product < n_devices and processes == 1):
        return []
    used = {a: n for a, n in sizes.items() if n > 1} or {"dp": 1}
    axis = max(used, key=lambda a: used[a])
    key = f"mesh.{axis}"
    span = options.span(key)
    shown = " × ".join(f"{a}={n}" for a, n in used.items())
    where = f"{n_devices} are available" if product > n_devices else \
        f"{n_devices} are available over {processes} processes, which must all take part"
    return [Diagnostic(f"the mesh has {product} devices ({shown}) but {where}", span=span, key=key,
                       hint=f"make the product of mesh axes {'at most ' if processes == 1 else ''}{n_devices}, "
                            f"e.g. dp={n_devices}")]


def build_mesh(options: CompileOptions, params, devices=None) -> Mesh:
    """A Mesh over the first options.mesh_size of `devices` (default: all) with the mesh's axes in order pp, dp,
    fsdp, ep, sp, tp. A mesh smaller than the devices present leaves the rest idle (`tessera run` says so)."""
    devices = list(jax.devices() if devices is None else devices)
    processes = jax.process_count()
    problems = (check_devices(options, len(devices), processes)
                + check_params_divide(params, options.rules, options.span))
    if problems:
        raise TesseraError(problems)
    devices = devices[:options.mesh_size]
    sizes = options.mesh_axes
    grid = np.asarray(devices, dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes))
