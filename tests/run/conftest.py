"""Fixtures for run/ tests: a fake program and Experiment-like specs (see runfake.py)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from runfake import FakeExperiment, cached_program, train_spec  # noqa: E402

from tessera.run.main import run_experiment  # noqa: E402


@pytest.fixture
def run_fake(tmp_path):
    """run_fake(spec, out=None, **kw) -> RunResult: run a spec dict with the fake program, quietly."""

    def go(spec: dict, out=None, program=cached_program, **kw):
        out = out if out is not None else tmp_path / "run"
        kw.setdefault("stream", io.StringIO())
        kw.setdefault("tensorboard", False)
        return run_experiment(FakeExperiment(spec), out=out, compile_fn=program, **kw)

    return go


@pytest.fixture
def small_spec():
    """A short train spec: 30 steps, checkpoints every 10, constant schedule (so `steps` can grow on resume)."""
    return train_spec(steps=30, schedule={"kind": "constant", "warmup_steps": 3, "min_lr_ratio": 0.0},
                      sample=None)
