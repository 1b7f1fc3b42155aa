"""`tessera.load_run(run_dir) -> (program, params)`: a finished (or interrupted) run, back in Python.

The run directory's manifest holds the resolved spec (every default filled) and the content of every file it
named; the program is compiled from that spec exactly as `tessera run` compiled it, and the parameters are
read from the newest checkpoint the run left (`manifest.checkpoint_dir`, else the spec's `checkpoint.dir`):

    prog, params = tessera.load_run("runs/pinn_kovasznay-20261127-150102-1a2b3c4d")
    uvp = prog.forward(params, xy)          # a PINN: float points [N, 2] -> [N, 3]
    logits = prog.forward(params, tokens)   # a language model: int tokens [B, S] -> [B, S, vocab]
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import jax
import yaml

from tessera.diagnostics import RunError
from tessera.run.manifest import MANIFEST, load_manifest


def _experiment(manifest: dict):
    """The run's experiment, from the manifest's resolved spec with its files located by content."""
    from tessera.run.replay import relocated_spec
    from tessera.spec import load_experiment

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.yaml"
        path.write_text(yaml.safe_dump(relocated_spec(manifest), sort_keys=False))
        return load_experiment(str(path), overrides=[])


def _checkpoint_dir(run_dir: Path, manifest: dict, exp) -> Path:
    recorded = manifest.get("checkpoint_dir")
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    ck = Path(getattr(exp.checkpoint, "dir", None) or "ckpt")
    return ck if ck.is_absolute() else run_dir / ck


def load_run(run_dir: str | Path, step: int | None = None) -> tuple[Any, dict]:
    """(program, params) of a run directory: its spec's program and the parameters of its newest checkpoint
    (or of checkpoint `step`). A directory without a manifest or a checkpoint is a RunError."""
    from tessera.run.checkpoint import Checkpoints, DamagedCheckpoint
    from tessera.run.main import default_compile

    run_dir = Path(run_dir)
    if not (run_dir / MANIFEST).is_file():
        raise RunError(f"{run_dir} holds no {MANIFEST}: not a run directory")
    manifest = load_manifest(run_dir)
    exp = _experiment(manifest)
    prog = default_compile(exp)
    ckpts = Checkpoints(_checkpoint_dir(run_dir, manifest, exp), keep=None)
    try:
        step = ckpts.latest_step() if step is None else step
        if step is None or step not in ckpts.all_steps():
            raise RunError(f"{ckpts.directory} holds no checkpoint"
                           + (f" at step {step}" if step is not None else "") + f" for the run in {run_dir}")
        seed = int(getattr(exp.task, "seed", 0))
        if prog.optimizer is not None:  # a train run checkpoints its whole TrainState
            target = jax.eval_shape(lambda: prog.init_train_state(prog.init(seed)))
        else:
            target = jax.eval_shape(lambda: prog.init(seed))
        try:
            state, _ = ckpts.restore(step, target)
        except DamagedCheckpoint as exc:
            raise RunError(f"checkpoint at step {step} in {ckpts.directory} is damaged: {exc}") from None
    finally:
        ckpts.close()
    params = state.params if hasattr(state, "params") else state
    return prog, dict(params)
