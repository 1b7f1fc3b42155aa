"""What a task gets to run with: the experiment, its program, the run directory and its records."""

from __future__ import annotations

import dataclasses
import signal
import threading
from pathlib import Path
from typing import Any, TextIO

from tessera.run.manifest import Manifest
from tessera.run.metrics import MetricsLog


@dataclasses.dataclass
class RunContext:
    """One run: `exp`, `prog`, where it writes, and whether it continues an earlier one."""

    exp: Any
    prog: Any
    run_dir: Path
    manifest: Manifest
    metrics: MetricsLog
    stream: TextIO
    weights: Path | None = None
    resume: bool = False
    spec_dir: Path | None = None  # relative data paths resolve against the spec's directory
    interrupt: "Interrupt | None" = None

    def say(self, text: str) -> None:
        """Print a line for the person running this."""
        print(text, file=self.stream, flush=True)

    def initial_params(self, split_layers: bool = False) -> dict:
        """Parameters to start from: the --weights checkpoint if given, else a seeded init; split_layers:
        each stacked parameter as its list of layers, made or read one layer at a time (generation)."""
        if self.weights is not None:
            return self.prog.load_weights(self.weights, split_layers=split_layers)
        return self.prog.init(int(self.exp.task.seed), split_layers=split_layers)

    def resolve(self, path: str | Path, base: Path | None = None) -> Path:
        """A path from the spec: absolute as is, relative against `base` (default: the run directory)."""
        path = Path(path)
        return path if path.is_absolute() else (base or self.run_dir) / path


class Interrupt:
    """Turns Ctrl-C (SIGINT) and a scheduler's SIGTERM into a flag the training loop polls, so it can
    checkpoint and stop cleanly; `signum` is the signal that asked (a second one stops at once)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "Interrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second signal stops at once
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum

    @property
    def name(self) -> str:
        """The signal's name (SIGINT, SIGTERM), or "" when none came."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
