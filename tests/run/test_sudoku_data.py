"""The sudoku data kind: puzzle sets made once and read back from the cache, blank ranges, the symmetries that
augment training puzzles (each keeps one solution, its image), batches as pure functions of (seed, step), the
held-out metrics (eval_exact, eval_cell_acc; a digit is the argmax over ids 1-9), and spec mistakes."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from tessera.diagnostics import TesseraError
from tessera.run.data import STREAM_EVAL
from tessera.run.sudoku import (SudokuSource, augment, blank_count, count_solutions, predicted_digits,
                                sudoku_puzzles, sudoku_set)
from tessera.spec.tasks import SudokuData
from tests.run.test_sudoku import _valid

from pathlib import Path

SPEC = Path(__file__).resolve().parents[2] / "specs" / "transformer_sudoku.yaml"


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_set_is_made_once_then_read_from_the_cache(cache):
    puzzles, solutions = sudoku_puzzles(seed=1, start=2, n=5, blanks=(4, 30))
    np.testing.assert_array_equal(puzzles, sudoku_set(1, 2, 5, (4, 30))[0])
    files = list((cache / "sudoku").glob("sudoku-*.npz"))
    assert len(files) == 1
    with np.load(files[0]) as stored:
        stored_puzzles = stored["puzzles"]
    stored_puzzles[0, 0] = 7  # what comes back is the file, not a fresh set
    np.savez(files[0], puzzles=stored_puzzles, solutions=solutions)
    assert sudoku_puzzles(seed=1, start=2, n=5, blanks=(4, 30))[0][0, 0] == 7
    assert not np.array_equal(sudoku_puzzles(seed=1, start=2, n=5, blanks=(4, 31))[0], stored_puzzles)


def test_blank_ranges_are_drawn_per_puzzle_within_bounds():
    counts = [blank_count(0, i, (10, 14)) for i in range(200)]
    assert set(counts) == {10, 11, 12, 13, 14}
    puzzles, _ = sudoku_set(0, 0, 6, (10, 14))
    assert [int((p == 0).sum()) for p in puzzles] == counts[:6]
    assert blank_count(0, 5, 20) == 20


def test_symmetries_keep_one_solution_the_image_of_the_old_one():
    puzzles, solutions = sudoku_set(2, 0, 8, 30)
    x, y = augment(puzzles, solutions, np.random.default_rng(0))
    assert not np.array_equal(x, puzzles)
    for p, s, p0 in zip(x, y, puzzles):
        assert _valid(s) and np.array_equal(p[p > 0], s[p > 0]) and count_solutions(p) == 1
        assert int((p == 0).sum()) == int((p0 == 0).sum())
    # the same rows, columns, transposition and digit map applied to both: blanks land where the solution's are
    assert np.array_equal(x == 0, (x == 0) & (y > 0))


def _source(**data) -> SudokuSource:
    spec = {"kind": "sudoku", "seed": 0, "train": 12, "eval": 6, "blanks": [5, 25], "eval_blanks": 20, **data}
    return SudokuSource(SudokuData.model_validate(spec, strict=False), batch=4)


def test_batches_are_pure_functions_of_the_step(cache):
    src = _source()
    b = src.batch(5)
    assert set(b) == {"tokens", "targets", "mask"}
    assert b["tokens"].shape == b["targets"].shape == b["mask"].shape == (4, 81)
    assert str(b["tokens"].dtype) == "int32" and float(b["mask"].min()) == 1.0
    np.testing.assert_array_equal(np.asarray(_source().batch(5)["tokens"]), np.asarray(b["tokens"]))
    assert not np.array_equal(np.asarray(src.batch(6)["tokens"]), np.asarray(b["tokens"]))
    ev = src.batch(0, STREAM_EVAL)  # held out, never augmented: rows of the eval set
    rows = {tuple(r) for r in src.eval[0]}
    assert all(tuple(r) in rows for r in np.asarray(ev["tokens"]))
    assert all(int((r == 0).sum()) == 20 for r in src.eval[0])
    plain = _source(augment=False).batch(5)["tokens"]
    assert {tuple(r) for r in np.asarray(plain)} <= {tuple(r) for r in src.train[0]}
    assert src.fingerprint != _source(seed=1).fingerprint


def test_eval_metrics_read_digits_from_ids_1_to_9(cache):
    src = _source()
    puzzles, solutions = src.eval

    def oracle(x, blank_logit=0.0):
        rows = [np.flatnonzero((puzzles == r).all(1))[0] for r in np.asarray(x)]
        logits = np.eye(12)[solutions[rows]] * 5.0  # vocab 12: ids 10, 11 are never a digit
        logits[..., 0] = blank_logit
        return logits

    assert src.errors(oracle) == {"eval_exact": 1.0, "eval_cell_acc": 1.0}
    assert src.errors(lambda x: oracle(x, blank_logit=50.0))["eval_exact"] == 1.0  # id 0 is never a digit

    def one_wrong(x):
        logits = oracle(x)
        first_blank = int(np.flatnonzero(np.asarray(x)[0] == 0)[0])
        logits[0, first_blank] = np.eye(12)[solutions[0, first_blank] % 9 + 1]  # another digit
        return logits

    got = src.errors(one_wrong)
    assert got["eval_exact"] == pytest.approx(5 / 6) and got["eval_cell_acc"] == pytest.approx(1 - 1 / 120)
    assert (predicted_digits(np.eye(10)[[0, 3, 9]]) == [1, 3, 9]).all()


@pytest.mark.parametrize("override, key, message", [
    ({"task.data.blanks": 61}, "task.data.blanks", "blanks are a whole number of cells from 0 to 60, got `61`"),
    ({"task.data.blanks": [30, 20]}, "task.data.blanks", "needs low <= high, got [30, 20]"),
    ({"task.data.blanks": [5, 10, 20]}, "task.data.blanks", "a range of blanks is [low, high], got 3 numbers"),
    ({"task.data.eval_blanks": [5, -1]}, "task.data.eval_blanks[1]", "got `-1`"),
    ({"task.seq_len": 64}, "task.seq_len", "a Sudoku puzzle is 81 tokens, but seq_len is 64"),
    ({"task.data.train": 0}, "task.data.train", "must be >= 1, got 0"),
])
def test_spec_mistakes_are_positioned_errors(override, key, message):
    with pytest.raises(TesseraError) as exc:
        tessera.load(SPEC, overrides=override)
    d = exc.value.diagnostics[0]
    assert message in d.message and d.key == key and d.span is not None, d


def test_a_mistake_in_the_file_points_at_its_line_and_column(tmp_path):
    text = SPEC.read_text().replace("../models/", str(SPEC.parents[1] / "models") + "/")
    assert "blanks: [10, 50]" in text
    path = tmp_path / "spec.yaml"
    path.write_text(text.replace("blanks: [10, 50]", "blanks: [10, 75]"))
    with pytest.raises(TesseraError) as exc:
        tessera.load(path)
    d = exc.value.diagnostics[0]
    line = path.read_text().splitlines()[d.span.line - 1]
    assert d.span.file == str(path) and line[d.span.col - 1:].startswith("75]"), (d, line)


@pytest.mark.parametrize("override, message", [
    ({"model.args.vocab": 9}, "a Sudoku cell's digit is the argmax of logits over ids 1-9"),
    ({"model.args.rows": 8}, "sudoku data gives int tokens [batch, 81]"),
])
def test_a_model_that_cannot_read_puzzles_is_refused_at_the_data_kind(override, message):
    from tessera.ir.check import check_experiment

    with pytest.raises(TesseraError) as exc:
        check_experiment(tessera.load(SPEC, overrides=override))
    d = exc.value.diagnostics[0]
    assert message in d.message and d.key == "task.data.kind" and d.span.file.endswith("transformer_sudoku.yaml")
