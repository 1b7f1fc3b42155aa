"""`tessera replay MANIFEST` and `tessera diff A B`: are two runs the same, bit for bit, and if not, where not.

Metric values in a manifest are JSON numbers; a float32 loss written as a Python float reads back
exactly, so equality here is bit equality.
"""

from __future__ import annotations

import datetime as _dt
import math
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

import yaml

from tessera.diagnostics import RunError
from tessera.run.checkpoint import spec_differences
from tessera.run.manifest import MANIFEST, load_manifest
from tessera.spec.files import by_content, locate, replaced

RUNS_DIR, SPEC_FILE = Path("runs"), "spec.yaml"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def first_metric_difference(a: list[dict], b: list[dict]) -> str | None:
    """Where two metric lists first differ (step, key, both values), or None when identical."""
    for i, (ra, rb) in enumerate(zip(a, b)):
        for key in sorted(set(ra) | set(rb)):
            if not _same(ra.get(key), rb.get(key)):
                return f"step {ra.get('step', i)}: {key} {ra.get(key)!r} != {rb.get(key)!r}"
    if len(a) != len(b):
        extra = (a if len(a) > len(b) else b)[min(len(a), len(b))]
        return f"record count {len(a)} != {len(b)} (first extra step {extra.get('step')})"
    return None


def compare(a: dict, b: dict) -> list[str]:
    """Differences between two manifests' numbers: data fingerprint, the first metric that differs, the checksum."""
    out = []
    if a.get("data_fingerprint") != b.get("data_fingerprint"):  # the likely cause of what follows
        out.append(f"data_fingerprint {a.get('data_fingerprint')} != {b.get('data_fingerprint')}")
    where = first_metric_difference(a.get("metrics") or [], b.get("metrics") or [])
    if where:
        out.append(f"metrics first differ at {where}")
    if a.get("params_checksum") != b.get("params_checksum"):
        out.append(f"params_checksum {a.get('params_checksum')} != {b.get('params_checksum')}")
    return out


def _load_spec_file(path: Path):
    from tessera.spec import load_experiment

    return load_experiment(str(path), overrides=[])


def _replay_dir(manifest: dict) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return RUNS_DIR / f"{manifest.get('name', 'run')}-{stamp}-{str(manifest.get('spec_hash'))[:8]}-replay"


def relocated_spec(manifest: dict) -> dict:
    """The manifest's spec with each named file pointed at a path holding the recorded content (the recorded
    path, else the recorded path relative to the working directory: another checkout of the same project)."""
    found = {}
    for dotted, record in (manifest.get("files") or {}).items():
        found[dotted], tried = locate(record)
        if found[dotted] is None:
            raise RunError(f"{dotted}: no file holds the content the run used (sha256 {record.get('sha256')}); "
                           f"tried {tried}. Run replay from the project's root, with the files the run used.")
    return replaced(manifest["spec"], found)


def replay(manifest_path: str | Path, out: str | Path | None = None, *,
           load_spec: Callable[[Path], Any] | None = None, compile_fn=None,
           stream: TextIO | None = None) -> tuple[dict, dict, list[str]]:
    """Re-run a manifest's spec into `out`; returns (original, replayed, differences)."""
    from tessera.run.main import run_experiment

    original = load_manifest(manifest_path)
    target = Path(out) if out is not None else _replay_dir(original)
    if (target / MANIFEST).exists():
        raise RunError(f"{target} already holds a run; replay needs a fresh directory")
    target.mkdir(parents=True, exist_ok=True)
    spec_path = target / SPEC_FILE
    spec_path.write_text(yaml.safe_dump(relocated_spec(original), sort_keys=False))
    exp = (load_spec or _load_spec_file)(spec_path)
    result = run_experiment(exp, out=target, weights=original.get("weights"), compile_fn=compile_fn,
                            overrides=original.get("overrides"), stream=stream)
    return original, result.manifest, compare(original, result.manifest)


def replay_command(manifest: str, out: str | None = None) -> int:
    """Exit 0 if the replay's metrics and final checksum are bit-identical to the manifest's, else 1."""
    original, again, diffs = replay(manifest, out)
    if original.get("status") != "completed":
        print(f"note: the original run's status is {original.get('status')!r}", file=sys.stderr)
    if not diffs:
        print(f"bit-identical: {len(again['metrics'])} metric records and params_checksum "
              f"{again['params_checksum']} (replay in {again.get('run_dir')})")
        return 0
    for line in diffs:
        print(f"differs: {line}")
    return 1


def diff_command(a: str, b: str, stream: TextIO | None = None) -> int:
    """Print spec differences, then the first metric difference and the checksums; exit 0 only if identical."""
    stream = stream or sys.stdout
    ma, mb = load_manifest(a), load_manifest(b)
    spec = spec_differences(by_content(ma["spec"], ma.get("files")), by_content(mb["spec"], mb.get("files")))
    for key, va, vb in spec:
        print(f"spec {key}: {va!r} -> {vb!r}", file=stream)
    if ma.get("ir_hash") != mb.get("ir_hash"):
        print(f"ir_hash: {ma.get('ir_hash')} -> {mb.get('ir_hash')}", file=stream)
    numbers = compare(ma, mb)
    for line in numbers:
        print(line, file=stream)
    if not spec and not numbers:
        print(f"identical: {len(ma.get('metrics') or [])} metric records, same spec and checksum", file=stream)
    return 0 if not spec and not numbers else 1
