"""Short versions of the shipped Sudoku specs (the non-causal transformer and HRM): the loss falls (both learn to
copy the clues, the transformer also fills blank cells far better than chance in 100 steps; HRM, trained by its
one-step gradient, needs many more), and `tessera.load_run` gives a program whose forward maps puzzles [B, 81]
to logits [B, 81, vocab] that score exactly as the run's metrics say."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import tessera
from tessera.run.main import run_experiment
from tessera.run.sudoku import SudokuSource, predicted_digits

ROOT = Path(__file__).resolve().parents[2]
SHORT = {"task.steps": 100, "task.batch": 32, "task.eval_every": 50, "task.eval_batches": 1, "task.log_every": 10,
         "task.schedule.warmup_steps": 5, "task.optimizer.lr": 5e-3, "task.data.train": 256, "task.data.eval": 48,
         "task.data.blanks": [1, 6], "task.data.eval_blanks": 3}
TINY = {"model.args.d_model": 32, "model.args.heads": 2, "model.args.head_dim": 16, "model.args.d_ff": 64}
# name: (spec, model overrides, blank-cell accuracy it must pass at step 100: a guess gets 1 in 9)
RUNS = {"transformer": ("transformer_sudoku.yaml", {"model.args.layers": 2}, 0.3),
        "hrm": ("hrm_sudoku.yaml", {"model.args.l_layers": 1, "model.args.h_layers": 1, "task.batch": 16}, 0.0)}


@pytest.fixture(scope="module", params=sorted(RUNS))
def sudoku_run(request, tmp_path_factory):
    spec, extra, _ = RUNS[request.param]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CACHE", str(tmp_path_factory.mktemp("sudoku-cache")))
        exp = tessera.load(ROOT / "specs" / spec, overrides={**SHORT, **TINY, **extra})
        result = run_experiment(exp, out=tmp_path_factory.mktemp(request.param) / "run", stream=io.StringIO(),
                                tensorboard=False)
        yield request.param, result


def test_the_loss_falls_and_held_out_cells_beat_their_bar(sudoku_run):
    name, run = sudoku_run
    records = run.metrics
    evals = [r for r in records if "eval_exact" in r]
    assert [r["step"] for r in evals] == [50, 100]
    assert records[-1]["loss"] < 0.1 * records[0]["loss"]  # from ln 10 (2.3) at the start
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[-1]["eval_cell_acc"] > RUNS[name][2]
    assert 0.0 <= evals[-1]["eval_exact"] <= 1.0


def test_load_run_maps_puzzles_to_logits_that_score_as_recorded(sudoku_run):
    _, run = sudoku_run
    prog, params = tessera.load_run(run.run_dir)
    src = SudokuSource(prog.exp.task.data, 8)
    puzzles, solutions = src.eval
    logits = np.asarray(prog.forward(params, puzzles))
    assert logits.shape == (48, 81, prog.vocab) and prog.vocab == 10
    right = predicted_digits(logits) == solutions
    last = [r for r in run.metrics if "eval_exact" in r][-1]
    assert float(right.all(axis=1).mean()) == last["eval_exact"]  # the same fractions of the same 48 puzzles
    assert float(right[puzzles == 0].mean()) == last["eval_cell_acc"]

