"""Progress reporting: a rich progress bar (loss, tokens/s, ETA) on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _fmt(rec: dict[str, Any]) -> str:
    parts = []
    for key, value in rec.items():
        if key == "step":
            continue
        parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return "  ".join(parts)


class Progress:
    """Shows training progress; use as a context manager, call `update(step, record)`, `note(text)`."""

    def __init__(self, total: int, start: int = 0, desc: str = "train", stream: TextIO | None = None):
        self.total, self.start, self.desc = total, start, desc
        self.stream = stream or sys.stdout
        self._tty = self.stream.isatty()
        self._bar = None
        self._last = (time.perf_counter(), start)  # ETA from the latest window: compile time does not skew it

    def __enter__(self) -> "Progress":
        if self._tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                            console=Console(file=self.stream))
            self._bar.__enter__()
            self._task = self._bar.add_task(self.desc, total=self.total, completed=self.start, info="")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None

    def update(self, step: int, record: dict[str, Any] | None = None) -> None:
        """Advance to `step` (steps completed) and show the latest record."""
        info = _fmt(record or {})
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
            return
        if record is not None:
            now, (t, s) = time.perf_counter(), self._last
            eta = (now - t) / max(step - s, 1) * (self.total - step)
            self._last = (now, step)
            print(f"{self.desc} step {step}/{self.total}  {info}  eta {eta:.0f}s", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """A message that does not disturb the bar."""
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, file=self.stream, flush=True)
