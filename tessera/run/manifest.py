"""`manifest.json`: everything needed to see what a run did and to reproduce it bit for bit.

The manifest is rewritten as the run goes (write to a temporary file, then `os.replace`), so a run
that is killed still leaves a valid manifest up to its last flushed step. Other tools read these
fixed top-level keys: `spec` (the resolved spec, itself a valid spec), `spec_hash`, `ir_hash`,
`versions`, `devices`, `seed`, `metrics` (records with `step`, and `loss` when training) and
`params_checksum` (sha256 over the final parameters' bytes in sorted path order). `files` records each
file the spec names (path, path relative to the working directory, fingerprint): `spec_hash` hashes files by
content, and `tessera replay` finds them again from another checkout.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tessera.spec.files import file_records

MANIFEST = "manifest.json"
FIXED_KEYS = ("spec", "spec_hash", "ir_hash", "versions", "devices", "seed", "metrics", "params_checksum")
PACKAGES = ("tessera", "jax", "jaxlib", "numpy", "optax", "orbax-checkpoint")


def now() -> str:
    """UTC time as ISO 8601 with seconds."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to `path` so readers only ever see the old or the new complete file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1, sort_keys=False, default=_jsonable)
        fh.write("\n")
    os.replace(tmp, path)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (np.generic,)):
        return obj.item()
    if isinstance(obj, (Path,)):
        return str(obj)
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def to_host(x: Any) -> np.ndarray:
    """A whole array on this host, gathering the shards other processes hold when there are several."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def params_checksum(params: dict[str, Any]) -> str:
    """sha256 hex digest of the parameters' bytes (C order, as stored), concatenated in sorted path order.

    A parameter held split into its layers (a list) hashes as its stacked form would: the stacked array's
    bytes are its layers' bytes one after another (a packed one's codes of every layer, then its scales)."""
    h = hashlib.sha256()
    for path in sorted(params):
        value = params[path]
        layers = [jax.tree.leaves(v) for v in value] if isinstance(value, list) else [jax.tree.leaves(value)]
        for j in range(len(layers[0])):  # a packed (MXFP4) parameter: its codes, then its scales
            for leaves in layers:
                h.update(np.ascontiguousarray(to_host(leaves[j])).tobytes())
    return h.hexdigest()


def device_memory() -> dict[str, float] | None:
    """This process's first device's allocator figures (peak and current bytes in use, the limit), None on a
    backend that keeps none (the CPU)."""
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if not stats:
        return None
    return {k: float(stats[k]) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit") if k in stats}


def versions() -> dict[str, str]:
    """Versions of Python and the packages that decide the numbers."""
    out = {"python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def devices() -> list[dict[str, Any]]:
    """The devices the run used: id, platform, kind, process."""
    return [{"id": d.id, "platform": d.platform, "kind": d.device_kind, "process": d.process_index}
            for d in jax.devices()]


def git_state(path: Path) -> dict[str, Any] | None:
    """Commit and dirty flag of the git repository holding `path`, or None outside one."""
    cwd = path if path.is_dir() else path.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                                timeout=10)
        if commit.returncode != 0:
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


class Manifest:
    """The manifest of one run directory, held in memory and flushed atomically on every change."""

    OVERHEAD = 0.05  # lazy flushes may spend at most this fraction of wall time rewriting the file

    def __init__(self, run_dir: Path, record: dict[str, Any]):
        self.path = Path(run_dir) / MANIFEST
        self.record = record
        self._last_write, self._write_cost = 0.0, 0.0

    @classmethod
    def start(cls, run_dir: Path, exp, *, ir_hash: str, seed: int, overrides, spec_file: Path | None,
              extra: dict | None = None) -> "Manifest":
        """A fresh manifest for `exp` with status `running`, written at once."""
        record = {
            "spec": exp.resolved(), "spec_hash": exp.spec_hash, "files": file_records(exp.resolved()),
            "ir_hash": ir_hash, "versions": versions(),
            "devices": devices(), "seed": seed, "metrics": [], "params_checksum": None,
            "name": exp.name, "task": exp.task.kind, "backend": jax.default_backend(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "pjrt_nproc": os.environ.get("PJRT_NPROC"),
            "overrides": _overrides(overrides),
            "git": git_state(spec_file) if spec_file else None, "data_fingerprint": None,
            "started_at": now(), "ended_at": None, "status": "running", "error": None, "resumed": [],
        }
        record.update(extra or {})
        manifest = cls(run_dir, record)
        manifest.flush()
        return manifest

    def update(self, lazy: bool = False, **fields: Any) -> None:
        """Set top-level fields and flush (see `flush` for `lazy`)."""
        self.record.update(fields)
        self.flush(lazy)

    def flush(self, lazy: bool = False) -> None:
        """Write the record to manifest.json atomically (temporary file, then rename).

        A lazy flush is skipped while rewriting would cost more than OVERHEAD of the time since the
        last write: small manifests are rewritten every time, a long run's large one less often.
        """
        if jax.process_index() != 0:  # one writer when several processes run the same spec
            return
        start = time.monotonic()
        if lazy and (start - self._last_write) * self.OVERHEAD < self._write_cost:
            return
        write_json_atomic(self.path, self.record)
        self._last_write = time.monotonic()
        self._write_cost = self._last_write - start

    def finish(self, status: str, error: str | None = None, **fields: Any) -> None:
        """Record the end: status (completed | failed | interrupted), the error if any, the end time."""
        self.update(status=status, error=error, ended_at=now(), **fields)


def _overrides(overrides) -> Any:
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        return {str(k): v for k, v in overrides.items()}
    return list(overrides)


def load_manifest(path: str | Path) -> dict[str, Any]:
    """Read a manifest file, or the manifest of a run directory."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)
