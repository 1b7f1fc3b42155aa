"""9x9 Sudoku puzzles with exactly one solution, the task data of recurrent reasoning models.

    puzzle, solution = sudoku_pair(seed=0, index=3, blanks=20)   # 81 ints each: 0 = blank, 1-9 = digits
    puzzles, solutions = sudoku_puzzles(seed=0, start=0, n=10000, blanks=(10, 50))   # cached on disk

Pair `index` of `seed` is a pure function of the two: a solved grid is drawn by a randomised backtracking
fill (any valid grid can come out), then cells are blanked in a random order, each only if the puzzle keeps
exactly one solution, until `blanks` cells are empty (a grid that cannot lose that many is replaced by the
next draw). Generating one takes 4 ms at 20 blanks, 26 ms at 50, on this CPU.
`count_solutions` is the exact backtracking count (most-constrained cell first), stopped at a limit.

`SudokuSource` feeds a train task (`data: {kind: sudoku, ...}`): the first `train` puzzles of the seed, shuffled
per epoch, each given a random symmetry of the puzzle per batch (`augment`), the next `eval` held out, on which
`errors` measures eval_exact and eval_cell_acc.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import numpy as np

from tessera.run.data import STREAM_EVAL
from tessera.run.datacache import cached
from tessera.spec.tasks import SUDOKU_CELLS as CELLS, SUDOKU_MAX_BLANKS as MAX_BLANKS

VERSION = 1  # of the generator: part of the cache key and the data fingerprint

_UNIT_OF = [(r, c, 3 * (r // 3) + c // 3) for r in range(9) for c in range(9)]


def _random_grid(rng: np.random.Generator) -> np.ndarray:
    """A solved grid drawn by filling the cells in order, each from its free digits in a random order, with
    backtracking: every valid grid can come out (shuffling one base grid by Sudoku's symmetries would give
    only the grids isomorphic to it, which share structure a model could learn instead of the rules)."""
    grid = [0] * CELLS
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    orders = [rng.permutation(9) + 1 for _ in range(CELLS)]

    def fill(i: int) -> bool:
        if i == CELLS:
            return True
        r, c, b = _UNIT_OF[i]
        used = rows[r] | cols[c] | boxes[b]
        for v in orders[i]:
            bit = 1 << int(v)
            if not used & bit:
                grid[i] = int(v)
                rows[r] |= bit
                cols[c] |= bit
                boxes[b] |= bit
                if fill(i + 1):
                    return True
                rows[r] &= ~bit
                cols[c] &= ~bit
                boxes[b] &= ~bit
        grid[i] = 0
        return False

    fill(0)
    return np.array(grid, np.int64)


def count_solutions(cells, limit: int = 2) -> int:
    """Solutions of the puzzle (81 ints, 0 = blank), counted up to `limit`; 0 for a contradictory one."""
    grid = [int(v) for v in cells]
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    for i, v in enumerate(grid):
        if v:
            r, c, b = _UNIT_OF[i]
            bit = 1 << v
            if rows[r] & bit or cols[c] & bit or boxes[b] & bit:
                return 0
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
    empty = [i for i, v in enumerate(grid) if not v]

    def search(found: int) -> int:
        best, best_free = -1, None
        for i in empty:  # the most constrained empty cell
            if grid[i]:
                continue
            r, c, b = _UNIT_OF[i]
            free = ~(rows[r] | cols[c] | boxes[b]) & 0x3FE
            if best_free is None or bin(free).count("1") < bin(best_free).count("1"):
                best, best_free = i, free
                if not free:
                    return found
        if best < 0:
            return found + 1
        r, c, b = _UNIT_OF[best]
        for v in range(1, 10):
            bit = 1 << v
            if best_free & bit:
                grid[best] = v
                rows[r] |= bit
                cols[c] |= bit
                boxes[b] |= bit
                found = search(found)
                grid[best] = 0
                rows[r] &= ~bit
                cols[c] &= ~bit
                boxes[b] &= ~bit
                if found >= limit:
                    return found
        return found

    return search(0)


def sudoku_pair(seed: int, index: int, blanks: int) -> tuple[np.ndarray, np.ndarray]:
    """(puzzle, solution), each int32 [81]: `blanks` zeros in the puzzle, whose only solution is `solution`."""
    if not 0 <= blanks <= MAX_BLANKS:
        raise ValueError(f"blanks must be 0 to {MAX_BLANKS}, got {blanks}")
    rng = np.random.default_rng([int(seed), int(index)])
    while True:
        solution = _random_grid(rng)
        puzzle = solution.copy()
        removed = 0
        for cell in rng.permutation(CELLS):
            if removed == blanks:
                break
            keep = puzzle[cell]
            puzzle[cell] = 0
            if count_solutions(puzzle) == 1:
                removed += 1
            else:
                puzzle[cell] = keep
        if removed == blanks:
            return puzzle.astype(np.int32), solution.astype(np.int32)


def blank_count(seed: int, index: int, blanks) -> int:
    """Blanks of puzzle `index`: `blanks` itself, or for a range (low, high) a uniform draw by (seed, index)."""
    if isinstance(blanks, int):
        return blanks
    low, high = blanks
    return int(np.random.default_rng([int(seed), int(index), 1]).integers(low, high + 1))


def sudoku_set(seed: int, start: int, n: int, blanks) -> tuple[np.ndarray, np.ndarray]:
    """Pairs start .. start + n - 1 of `seed`: (puzzles, solutions), each int32 [n, 81]; `blanks` a number or
    a range (low, high), inclusive, drawn per puzzle."""
    pairs = [sudoku_pair(seed, i, blank_count(seed, i, blanks)) for i in range(start, start + n)]
    return np.stack([p for p, _ in pairs]), np.stack([s for _, s in pairs])


def sudoku_puzzles(seed: int, start: int, n: int, blanks, *, cache: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`sudoku_set`, kept on disk by the hash of its settings (tessera/run/datacache.py): 10,000 puzzles of
    10-50 blanks take about two minutes to make."""
    blanks = blanks if isinstance(blanks, int) else [int(b) for b in blanks]
    what = {"kind": "sudoku", "version": VERSION, "seed": seed, "start": start, "n": n, "blanks": blanks}

    def make():
        puzzles, solutions = sudoku_set(seed, start, n, blanks)
        return {"puzzles": puzzles, "solutions": solutions}

    found = cached("sudoku", "sudoku", what, make, cache=cache)
    return found["puzzles"], found["solutions"]


def _orders(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random orders of 9 rows (or columns) that keep Sudoku's units: the bands permuted, and the rows within
    each band: int [n, 9]."""
    bands = rng.permuted(np.tile(np.arange(3), (n, 1)), axis=1)              # [n, 3]
    within = rng.permuted(np.tile(np.arange(3), (n, 3, 1)), axis=2)          # [n, 3 bands, 3 rows]
    return (3 * bands[:, :, None] + within).reshape(n, 9)


def symmetries(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n random symmetries of the grid: cell orders int [n, 81] (cell k of the new grid is cell order[k] of the
    old) and digit maps int [n, 10] (0 stays 0). A puzzle under one keeps exactly one solution, its image."""
    rows, cols = _orders(rng, n), _orders(rng, n)
    order = rows[:, :, None] * 9 + cols[:, None, :]                         # [n, 9, 9]
    flip = rng.random(n) < 0.5
    order[flip] = order[flip].transpose(0, 2, 1)
    digits = np.concatenate([np.zeros((n, 1), np.int64), rng.permuted(np.tile(np.arange(1, 10), (n, 1)), axis=1)],
                            axis=1)
    return order.reshape(n, CELLS), digits


def augment(puzzles: np.ndarray, solutions: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Each (puzzle, solution) [n, 81] under its own random symmetry."""
    order, digits = symmetries(rng, len(puzzles))
    rows = np.arange(len(puzzles))[:, None]
    return (digits[rows, np.take_along_axis(puzzles, order, 1)].astype(np.int32),
            digits[rows, np.take_along_axis(solutions, order, 1)].astype(np.int32))


def predicted_digits(logits) -> np.ndarray:
    """A cell's digit: the argmax of its logits over token ids 1-9. logits [..., vocab] -> int [...]."""
    return np.argmax(np.asarray(logits)[..., 1:10], axis=-1) + 1


class SudokuSource:
    """Batches of {tokens: puzzles, targets: solutions, mask: ones}, each [batch, 81], for a train task: the first
    `train` puzzles of `seed`, shuffled each epoch by (seed, epoch), each under a random symmetry per batch when
    `augment`; evaluation batches, eval_exact and eval_cell_acc from the next `eval` puzzles (held out)."""

    def __init__(self, data, batch: int):
        self.data, self.size = data, int(batch)
        n = int(data.train)
        eval_blanks = data.blanks if data.eval_blanks is None else data.eval_blanks
        self.train = sudoku_puzzles(int(data.seed), 0, n, _blanks(data.blanks))
        self.eval = sudoku_puzzles(int(data.seed), n, int(data.eval), _blanks(eval_blanks))
        self._last: dict = {}

    @property
    def fingerprint(self) -> str:
        # the puzzles are a pure function of these settings and the generator's version
        text = json.dumps({**self.data.model_dump(mode="json"), "version": VERSION}, sort_keys=True)
        return "sudoku:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def batch(self, step: int, stream: int = 0) -> dict:
        """Step `step`'s puzzles {tokens, targets int32, mask float32} [batch, 81] (stream 0: training, else the
        held-out puzzles, never augmented)."""
        puzzles, solutions = self.eval if stream == STREAM_EVAL else self.train
        n, b = len(puzzles), min(self.size, len(puzzles))
        epoch, k = divmod(int(step), max(n // b, 1))
        order = np.random.default_rng([int(self.data.seed), int(stream), epoch]).permutation(n)
        idx = order[k * b:(k + 1) * b]
        key = (stream, int(step))
        if self._last.get("key") != key:
            x, y = puzzles[idx], solutions[idx]
            if self.data.augment and stream != STREAM_EVAL:
                x, y = augment(x, y, np.random.default_rng([int(self.data.seed), int(stream), int(step), 1]))
            self._last.update(key=key, batch=jax.device_put(
                {"tokens": x.astype(np.int32), "targets": y.astype(np.int32), "mask": np.ones(x.shape, np.float32)}))
        return self._last["batch"]

    def errors(self, forward, chunk: int = 500) -> dict[str, float]:
        """eval_exact: the fraction of held-out puzzles solved in every cell; eval_cell_acc: of their blank cells,
        the fraction right (a cell's digit is the argmax of its logits over ids 1-9)."""
        puzzles, solutions = self.eval
        pred = np.concatenate([predicted_digits(forward(puzzles[i:i + chunk])) for i in range(0, len(puzzles), chunk)])
        right = pred == solutions
        return {"eval_exact": float(right.all(axis=1).mean()), "eval_cell_acc": float(right[puzzles == 0].mean())}


def _blanks(value):
    """A spec's blanks (an int or [low, high]) as sudoku_set takes them."""
    return value if isinstance(value, int) else (int(value[0]), int(value[1]))
