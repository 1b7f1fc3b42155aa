"""Short versions of the shipped Sudoku specs (the non-causal transformer, and HRM with deep supervision and ACT:
2 segments, which the shipped spec's 1 leaves out), on tiny shapes and easy puzzles (1-6 blanks): both learn, and
`tessera.load_run` gives a program whose forward maps puzzles [B, 81] to logits [B, 81, vocab] that score exactly
as the run's metrics say.

What "learn" means here, in the few steps CI affords: both copy the clues (the cross-entropy over all 81 cells
falls from about ln 10 = 2.3 to under a tenth of that; a model that cannot learn stays near 2.3), and the held-out
loss falls. The transformer also fills blank cells far better than chance (1 in 9) by step 100; HRM, whose
gradient reaches its weights through the last step of each segment only, needs more steps than CI affords for
that, so its bar is the loss, its halting head's loss falling (it learns that its predictions are not yet right),
and every puzzle running one or both of its 2 segments."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest

import tessera
from tessera.run.main import run_experiment
from tessera.run.sudoku import SudokuSource, predicted_digits

ROOT = Path(__file__).resolve().parents[2]
SHORT = {"task.batch": 32, "task.eval_batches": 1, "task.log_every": 10, "task.schedule.warmup_steps": 5,
         "task.optimizer.lr": 5e-3, "task.data.train": 256, "task.data.eval": 48, "task.data.blanks": [1, 6],
         "task.data.eval_blanks": 3}
TINY = {"model.args.d_model": 32, "model.args.heads": 2, "model.args.head_dim": 16, "model.args.d_ff": 64}
# name: (spec, overrides, steps, blank-cell accuracy it must pass at the end: a guess gets 1 in 9)
RUNS = {"transformer": ("transformer_sudoku.yaml", {"model.args.layers": 2}, 100, 0.3),
        "hrm": ("hrm_sudoku.yaml", {"model.args.l_layers": 1, "model.args.h_layers": 1, "model.args.segments": 2,
                                    "model.args.act": True, "task.batch": 16}, 60, None)}


@pytest.fixture(scope="module", params=sorted(RUNS))
def sudoku_run(request, tmp_path_factory):
    spec, extra, steps, _ = RUNS[request.param]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CACHE", str(tmp_path_factory.mktemp("sudoku-cache")))
        over = {**SHORT, **TINY, "task.steps": steps, "task.eval_every": steps // 2, **extra}
        exp = tessera.load(ROOT / "specs" / spec, overrides=over)
        result = run_experiment(exp, out=tmp_path_factory.mktemp(request.param) / "run", stream=io.StringIO(),
                                tensorboard=False)
        yield request.param, result


def test_the_loss_falls_and_held_out_cells_beat_their_bar(sudoku_run):
    name, run = sudoku_run
    _, _, steps, bar = RUNS[name]
    records = run.metrics
    evals = [r for r in records if "eval_exact" in r]
    assert [r["step"] for r in evals] == [steps // 2, steps]
    ce = "lm" if name == "hrm" else "loss"  # HRM's loss adds its halting head's terms to the cross-entropy
    # at the start about ln 10 (HRM's: the segments run, of 2, times ln 10 / 2), at the end under a tenth of it
    assert records[0][ce] > 0.45 * math.log(10) and records[-1][ce] < 0.1 * math.log(10)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert 0.0 <= evals[-1]["eval_exact"] <= 1.0
    if bar is not None:
        assert evals[-1]["eval_cell_acc"] > bar
    if name == "hrm":
        assert records[-1]["q_halt"] < 0.5 * records[0]["q_halt"]
        assert all(1.0 <= r["segments"] <= 2.0 for r in records)


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
