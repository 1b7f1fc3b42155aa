"""Checkpoints through orbax: the train state plus a JSON record of where the run stood.

A checkpoint `<dir>/<step>/` holds `state` (the TrainState pytree: step, params, optimizer state) and
`meta` (data step, RNG seed, the resolved spec that made it, the metrics so far). Orbax writes each
one into a temporary directory and renames it when complete, so a process killed mid-save leaves
the previous checkpoint as the latest; half-written directories are ignored and cleaned up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import orbax.checkpoint as ocp

from tessera.diagnostics import Diagnostic, TesseraError
from tessera.spec.files import by_content, file_records

ABSENT = "(absent)"  # shown for a key one spec has and the other lacks

# Spec keys a resumed run may change without making the checkpoint incompatible (dotted prefixes).
RESUMABLE_CHANGES = (
    "name", "checkpoint", "task.steps", "task.log_every", "task.eval_every", "task.eval_batches",
    "task.sample", "mesh", "parallel", "kernels",
)


class Checkpoints:
    """Save / find / restore checkpoints in one directory, keeping the newest `keep`."""

    def __init__(self, directory: str | Path, keep: int | None):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep or None, create=True,
                                               cleanup_tmp_directories=True)
        self._mgr = ocp.CheckpointManager(self.directory, item_names=("state", "meta"), options=options)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of every complete checkpoint kept."""
        return list(self._mgr.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write the state and its meta record as checkpoint `step` (replacing nothing that exists)."""
        if step in self._mgr.all_steps():
            return
        self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)

    def read_meta(self, step: int) -> dict:
        """Only the JSON record of checkpoint `step` (cheap: no arrays are read)."""
        return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        """The state of checkpoint `step`, laid out (structure, dtypes, shardings) like `target`."""
        out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                              meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def wait(self) -> None:
        """Block until any save in flight is finished and renamed into place."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self._mgr.wait_until_finished()
        self._mgr.close()


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested spec dict as {dotted.key: leaf}; lists are leaves."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def spec_differences(old: dict, new: dict, ignore: Iterable[str] = ()) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every leaf that differs, skipping keys under `ignore` prefixes."""
    a, b = flatten(old), flatten(new)
    ignore = tuple(ignore)

    def ignored(key: str) -> bool:
        return any(key == p or key.startswith(p + ".") for p in ignore)

    missing = ABSENT
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if not ignored(k) and a.get(k, missing) != b.get(k, missing)]


def check_compatible(exp, saved_spec: dict, current_spec: dict, where: Path, saved_files: dict | None = None) -> None:
    """Refuse to resume from a checkpoint made by a different spec, naming every field that differs.

    Files the save recorded (`saved_files`: path and fingerprint) compare by content, so a moved checkout resumes
    and an edited model file does not."""
    if saved_files:
        saved_spec, current_spec = by_content(saved_spec, saved_files), by_content(current_spec, file_records(current_spec))
    diffs = spec_differences(saved_spec, current_spec, RESUMABLE_CHANGES)
    if not diffs:
        return
    span_of = getattr(exp, "span", None)
    diags = [Diagnostic(f"differs from the checkpoint in {where}: checkpoint has {old!r}, spec has {new!r}",
                        span=span_of(key) if callable(span_of) else None, key=key,
                        hint="use a fresh --out directory, or restore the checkpoint's value")
             for key, old, new in diffs]
    raise TesseraError(diags)
