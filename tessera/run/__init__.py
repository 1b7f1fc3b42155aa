"""Running experiments: `tessera run`, the run directory and its manifest, checkpoints, replay.

main.py (run_experiment, run_command) → tasks/ (train, generate, forward, bench) over a compiled
program; data.py, optim.py, checkpoint.py, manifest.py, metrics.py, progress.py; replay.py (replay, diff).
"""
