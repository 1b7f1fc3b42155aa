"""A Fourier neural operator on Burgers pairs from a spec: a short run whose held-out relative error falls,
`tessera.load_run` mapping initial conditions to solutions, and positioned spec errors."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import tessera
from tessera.diagnostics import TesseraError
from tessera.run.main import run_experiment
from tessera.run.pde import BurgersSource

ROOT = Path(__file__).resolve().parents[2]
FNO = ROOT / "specs" / "fno_burgers.yaml"
SMALL = {"model.args.width": 8, "model.args.modes": 6, "model.args.layers": 2, "model.args.proj": 16,
         "task.steps": 150, "task.batch": 8, "task.data.train": 48, "task.data.eval": 16, "task.eval_every": 75,
         "task.eval_batches": 2, "task.log_every": 25, "task.schedule.warmup_steps": 5, "task.optimizer.lr": 3e-3}


@pytest.fixture(scope="module")
def fno_run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("pde-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CACHE", str(cache))
        exp = tessera.load(FNO, overrides=SMALL)
        return run_experiment(exp, out=tmp_path_factory.mktemp("fno") / "run", stream=io.StringIO(),
                              tensorboard=False)


def test_a_short_fno_run_brings_the_held_out_error_down(fno_run):
    evals = [r for r in fno_run.metrics if "eval_rel_l2" in r]
    assert [r["step"] for r in evals] == [75, 150]
    first, last = fno_run.metrics[0], fno_run.metrics[-1]
    assert "relative_l2" in last and last["relative_l2"] < 0.5 * first["relative_l2"]
    prog, params = tessera.load_run(fno_run.run_dir)
    untrained = prog.init(0)
    src = BurgersSource(prog.exp.task.data, 8)
    before = src.errors(lambda u: prog.forward(untrained, u))["eval_rel_l2"]
    assert evals[-1]["eval_rel_l2"] < 0.5 * before


def test_load_run_maps_initial_conditions_to_solutions(fno_run):
    prog, params = tessera.load_run(fno_run.run_dir)
    src = BurgersSource(prog.exp.task.data, 8)
    u0, u1 = src.eval
    pred = np.asarray(prog.forward(params, u0))
    assert pred.shape == u1.shape == (16, 64)
    rel = np.mean(np.linalg.norm(pred - u1, axis=1) / np.linalg.norm(u1, axis=1))
    assert rel == pytest.approx(fno_run.metrics[-1]["eval_rel_l2"], rel=1e-5)


@pytest.mark.parametrize("overrides, key, message", [
    ({"task.data.resolution": 100}, "task.data.resolution", "must divide the solver's 1024 points"),
    ({"task.data.resolution": 32}, "task.data.resolution", "the data has 32 points per function"),
])
def test_spec_mistakes_are_positioned_errors(overrides, key, message):
    with pytest.raises(TesseraError) as exc:
        from tessera.ir.check import check_experiment

        check_experiment(tessera.load(FNO, overrides=overrides))
    d = exc.value.diagnostics[0]
    assert message in d.message and d.span is not None
