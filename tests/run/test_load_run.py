"""`tessera.load_run(run_dir)`: the program and the newest checkpoint's parameters of a run directory."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import tessera
from tessera.diagnostics import RunError
from tessera.run.main import run_experiment

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("spec", ["llama_tiny"])  # gpt_oss_tiny passes too (22 s: kept out of CI)
def test_load_run_gives_the_trained_parameters_and_their_logits(spec, tmp_path):
    overrides = {"task.steps": 2, "task.batch": 2, "task.seq_len": 8, "task.sample": None,
                 "task.eval_batches": 1, "model.args.layers": 1, "checkpoint.every": 1}
    exp = tessera.load(ROOT / "specs" / f"{spec}.yaml", overrides=overrides)
    result = run_experiment(exp, out=tmp_path / "run", stream=io.StringIO(), tensorboard=False)
    assert result.status == "completed"
    prog, params = tessera.load_run(tmp_path / "run")
    from tessera.run.manifest import params_checksum

    assert params_checksum(params) == result.params_checksum  # the final step's parameters, bit for bit
    fresh = prog.init(0)
    assert any(not np.array_equal(np.asarray(fresh[k]), np.asarray(params[k])) for k in params)  # trained
    tokens = np.arange(8, dtype=np.int32).reshape(1, 8)
    logits = np.asarray(prog.forward(params, tokens))
    assert logits.shape == (1, 8, 256) and np.isfinite(logits).all()
    _, older = tessera.load_run(tmp_path / "run", step=1)
    assert params_checksum(older) != result.params_checksum


def test_load_run_of_a_directory_without_a_run_is_a_run_error(tmp_path):
    with pytest.raises(RunError, match="not a run directory"):
        tessera.load_run(tmp_path)
