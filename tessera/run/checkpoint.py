"""Checkpoints through orbax: the train state plus a JSON record of where the run stood.

A checkpoint `<dir>/<step>/` holds `state` (the TrainState pytree: step, params, optimizer state) and
`meta` (data step, RNG seed, the resolved spec that made it, the metrics so far, and `digest`: two
checksums of every state tensor's bits). Orbax writes each one into a temporary directory and renames
it when complete, so a process killed mid-save leaves the previous checkpoint as the latest;
half-written directories are ignored and cleaned up. Orbax stores no checksums of its own (a flipped
byte in a data file restores as a wrong number), so `Checkpoints.restore` compares the digest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from tessera.diagnostics import Diagnostic, RunError, TesseraError
from tessera.spec.files import by_content, file_records

ABSENT = "(absent)"  # shown for a key one spec has and the other lacks

# Spec keys a resumed run may change without making the checkpoint incompatible (dotted prefixes).
RESUMABLE_CHANGES = (
    "name", "checkpoint", "task.steps", "task.log_every", "task.eval_every", "task.eval_batches",
    "task.sample", "mesh", "parallel", "kernels",
)


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be read back as it was written (truncated, missing or corrupted files)."""


@jax.jit
def _digests(leaves: list) -> list:
    """Per tensor, uint32 [2]: the sum of its 32-bit words and their sum weighted by 2i+1 (wrapping).

    Any one flipped bit changes the first; swapped words change the second. Integer sums do not depend
    on the order of reduction, so the digest is the same on any mesh.
    """
    out = []
    for x in leaves:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        x = jnp.asarray(x).reshape(-1)
        if x.dtype.itemsize == 8:
            words = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
        elif x.dtype == jnp.bool_:
            words = x.astype(jnp.uint32)
        else:
            words = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
        odd = (2 * jnp.arange(words.shape[0], dtype=jnp.uint32) + 1)
        out.append(jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * odd, dtype=jnp.uint32)]))
    return out


def state_digest(state: Any) -> dict[str, list[int]]:
    """{tensor path: [sum, weighted sum]} of a state's tensors (see `_digests`), for a checkpoint's meta."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    sums = jax.device_get(_digests([leaf for _, leaf in flat]))
    return {jax.tree_util.keystr(path): [int(v) for v in np.asarray(d)] for (path, _), d in zip(flat, sums)}


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
        """Write the state and its meta record (plus the state's `digest`) as checkpoint `step`
        (replacing nothing that exists)."""
        if step in self._mgr.all_steps():
            return
        meta = {**meta, "digest": state_digest(state)}
        try:
            self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as exc:
            raise self._write_failed(step, exc) from None

    def read_meta(self, step: int) -> dict:
        """Only the JSON record of checkpoint `step` (cheap: no arrays are read); DamagedCheckpoint if unreadable."""
        try:
            meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            return {k: v for k, v in meta.items() if k != "digest"}
        except Exception as exc:  # orbax raises what its readers raise (JSON, TensorStore, OS errors)
            raise DamagedCheckpoint(f"its record (meta) cannot be read: {_first_line(exc)}") from None

    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        """The state of checkpoint `step`, laid out (structure, dtypes, shardings) like `target`.

        DamagedCheckpoint if a file is missing or cut short, or a tensor's bits differ from the digest
        written with it (checkpoints from before the digest are not compared)."""
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                  meta=ocp.args.JsonRestore()))
        except Exception as exc:
            raise DamagedCheckpoint(f"its tensors cannot be read: {_first_line(exc)}") from None
        meta = dict(out["meta"])
        want = meta.pop("digest", None)  # the checkpoint's own record, not the caller's
        if want is not None:
            got = state_digest(out["state"])
            bad = [path for path in want if got.get(path) != want[path]]
            if bad:
                raise DamagedCheckpoint(f"{len(bad)} tensor(s) differ from what was written: "
                                        + ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
        return out["state"], meta

    def wait(self) -> None:
        """Block until any save in flight is finished and renamed into place."""
        try:
            self._mgr.wait_until_finished()
        except Exception as exc:  # an asynchronous save's failure surfaces here
            raise self._write_failed(None, exc) from None

    def _write_failed(self, step: int | None, exc: Exception) -> RunError:
        """A save that failed (a full disk, a lost mount): what was lost and what is kept. Orbax writes into
        a temporary directory renamed only when complete, so the newest complete checkpoint is intact."""
        kept = self._mgr.latest_step()
        what = f"checkpoint at step {step}" if step is not None else "a checkpoint"
        keep = (f"the checkpoint at step {kept} is intact; free space and continue with --resume" if kept is not None
                else "no earlier checkpoint was written")
        return RunError(f"{what} could not be written to {self.directory}: {_first_line(exc)}; {keep}")

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        try:
            self.wait()
        finally:
            self._mgr.close()


def _first_line(exc: Exception) -> str:
    """The exception's first line, short: TensorStore's errors go on with the whole store spec."""
    text = str(exc).strip().splitlines()
    first = text[0].split(" See full TensorStore details")[0] if text else ""
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


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
