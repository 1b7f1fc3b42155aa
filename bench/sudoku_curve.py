"""Trained Sudoku runs scored on fresh puzzles at each number of blanks, as a grader outside the project would.

    python -m bench.sudoku_curve RUN_DIR [RUN_DIR ...] [--blanks 10,20,30,40,50] [--puzzles 500]

For each run, `tessera.load_run` gives (program, params); each blank count gets `--puzzles` puzzles of seed
1000 + blanks (never a training seed of the shipped specs, whose puzzles are seed 0), scored as the train task
scores its held-out ones: exact (every cell right, a cell's digit the argmax of its logits over ids 1-9) and
the accuracy on blank cells. Prints a Markdown table, one row per run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tessera
from tessera.run.sudoku import predicted_digits, sudoku_puzzles

SEED = 1000


def score(prog, params, blanks: int, n: int) -> tuple[float, float]:
    """(exact, blank-cell accuracy) of a program on n fresh puzzles with `blanks` blanks."""
    puzzles, solutions = sudoku_puzzles(SEED + blanks, 0, n, blanks)
    pred = np.concatenate([predicted_digits(prog.forward(params, puzzles[i:i + 250])) for i in range(0, n, 250)])
    right = pred == solutions
    return float(right.all(axis=1).mean()), float(right[puzzles == 0].mean()) if blanks else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--blanks", default="10,20,30,40,50")
    ap.add_argument("--puzzles", type=int, default=500)
    args = ap.parse_args()
    counts = [int(b) for b in args.blanks.split(",")]
    print("| run | " + " | ".join(f"{b} blanks: exact / cells" for b in counts) + " |")
    print("|---|" + "---|" * len(counts))
    for run in args.runs:
        t0 = time.perf_counter()
        prog, params = tessera.load_run(run)
        cells = [score(prog, params, b, args.puzzles) for b in counts]
        print(f"| {prog.exp.name} ({run}) | " + " | ".join(f"{e:.3f} / {c:.4f}" for e, c in cells)
              + f" |  <!-- {time.perf_counter() - t0:.0f} s -->")


if __name__ == "__main__":
    main()
