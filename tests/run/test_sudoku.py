"""Sudoku puzzles for recurrent reasoning: each has the blanks asked for and exactly one solution (checked by
an independent solver written here), the solution is a valid grid agreeing with the clues, and pairs are
pure functions of (seed, index)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tessera.run.sudoku import count_solutions, sudoku_pair, sudoku_set


def _solutions(puzzle, limit=2):
    """Every completion of the puzzle (up to `limit`), by plain depth-first search in cell order."""
    grid = [list(puzzle[r * 9:(r + 1) * 9]) for r in range(9)]
    out = []

    def ok(r, c, v):
        if v in grid[r] or v in (grid[i][c] for i in range(9)):
            return False
        br, bc = 3 * (r // 3), 3 * (c // 3)
        return all(grid[br + i][bc + j] != v for i in range(3) for j in range(3))

    def go(k):
        if len(out) >= limit:
            return
        if k == 81:
            out.append([v for row in grid for v in row])
            return
        r, c = divmod(k, 9)
        if grid[r][c]:
            return go(k + 1)
        for v in range(1, 10):
            if ok(r, c, v):
                grid[r][c] = v
                go(k + 1)
                grid[r][c] = 0

    go(0)
    return out


def _valid(grid) -> bool:
    g = np.asarray(grid).reshape(9, 9)
    units = [g[r] for r in range(9)] + [g[:, c] for c in range(9)]
    units += [g[3 * i:3 * i + 3, 3 * j:3 * j + 3].ravel() for i, j in itertools.product(range(3), range(3))]
    return all(sorted(u.tolist()) == list(range(1, 10)) for u in units)


@pytest.mark.parametrize("blanks", [0, 20, 45])
def test_puzzles_have_the_blanks_asked_for_and_one_solution(blanks):
    puzzles, solutions = sudoku_set(seed=3, start=0, n=4, blanks=blanks)
    assert puzzles.shape == solutions.shape == (4, 81) and puzzles.dtype == np.int32
    for p, s in zip(puzzles, solutions):
        assert int((p == 0).sum()) == blanks and _valid(s)
        assert np.array_equal(p[p > 0], s[p > 0])               # the clues are the solution's digits
        assert _solutions(p.tolist()) == [s.tolist()]           # exactly one completion, and it is `s`
        assert count_solutions(p) == 1


def _rectangle(s):
    """Two digits a, b at the corners of a rectangle spanning two boxes of one band (a b / b a): swapping them
    gives a second valid grid, so the puzzle without those four cells has two solutions."""
    for r1, r2, c1, c2 in itertools.product(range(9), range(9), range(9), range(9)):
        if r1 < r2 and c1 < c2 and r1 // 3 == r2 // 3 and c1 // 3 != c2 // 3:
            a, b = s[r1 * 9 + c1], s[r1 * 9 + c2]
            if s[r2 * 9 + c1] == b and s[r2 * 9 + c2] == a:
                return r1, r2, c1, c2
    return None


def test_the_solver_counts_several_solutions_and_contradictions():
    grids = (sudoku_pair(seed=0, index=i, blanks=0)[1] for i in range(50))
    s, found = next((g, f) for g in grids if (f := _rectangle(g)) is not None)
    open_rect = s.copy()
    r1, r2, c1, c2 = found
    for r, c in itertools.product((r1, r2), (c1, c2)):
        open_rect[r * 9 + c] = 0
    assert count_solutions(open_rect) == 2 and len(_solutions(open_rect.tolist())) == 2
    clash = s.copy()
    clash[1] = clash[0]  # a repeated digit in the first row
    assert count_solutions(clash) == 0
    assert count_solutions(np.zeros(81, np.int32), limit=5) == 5


def test_pairs_depend_on_seed_and_index_only():
    a = sudoku_pair(seed=7, index=2, blanks=30)
    b = sudoku_set(seed=7, start=0, n=3, blanks=30)
    np.testing.assert_array_equal(a[0], b[0][2])
    np.testing.assert_array_equal(a[1], b[1][2])
    assert not np.array_equal(sudoku_pair(seed=8, index=2, blanks=30)[1], a[1])
    assert not np.array_equal(b[1][0], b[1][1])
    with pytest.raises(ValueError, match="blanks must be 0 to 60"):
        sudoku_pair(seed=0, index=0, blanks=70)
