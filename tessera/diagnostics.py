"""User-facing diagnostics: `FILE:LINE:COL: error: <key.path>: <message>` with the source line and a caret.

Every mistake a user can make in a spec file or a model file is reported through this module, so
that the command line can print them all at once and exit 2 without a traceback. Lines and columns
are 1-based, as editors count them.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Iterable, Sequence


@dataclasses.dataclass(frozen=True)
class Span:
    """A position in a source file (1-based line and column); `end_col` is exclusive when known."""

    file: str
    line: int
    col: int
    end_col: int | None = None
    # The source line itself, for spans into text that is not a file (a `--set` override).
    text: str | None = dataclasses.field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclasses.dataclass(frozen=True)
class Diagnostic:
    """One problem: where, which key, what is wrong, and optionally how to fix it."""

    message: str
    span: Span | None = None
    key: str | None = None  # dotted key path in a spec ("task.optimizer.lr"), or None
    hint: str | None = None  # a fix-it ("did you mean `microbatches`?")
    source_line: str | None = None  # the line the span points into, if the source is not a file
    severity: str = "error"

    def render(self) -> str:
        """The diagnostic as printed: header line, then the source line with a caret under the span."""
        where = f"{self.span}: " if self.span else ""
        key = f"{self.key}: " if self.key else ""
        text = f"{where}{self.severity}: {key}{self.message}"
        if self.hint:
            text += f"; {self.hint}"
        excerpt = self._excerpt()
        return text + ("\n" + excerpt if excerpt else "")

    def _excerpt(self) -> str:
        if self.span is None:
            return ""
        line = self.source_line if self.source_line is not None else self.span.text
        if line is None:
            line = _read_line(self.span.file, self.span.line)
        if line is None:
            return ""
        line = line.rstrip("\n").expandtabs(1)
        width = 1
        if self.span.end_col is not None and self.span.end_col > self.span.col:
            width = self.span.end_col - self.span.col
        caret = " " * (self.span.col - 1) + "^" + "~" * (width - 1)
        return f"    {line}\n    {caret}"


def _read_line(file: str, line: int) -> str | None:
    try:
        with open(file, encoding="utf-8", errors="replace") as fh:
            for number, text in enumerate(fh, start=1):
                if number == line:
                    return text
    except OSError:
        return None
    return None


class TesseraError(Exception):
    """A mistake in the user's input: carries every diagnostic found. The CLI prints them and exits 2."""

    def __init__(self, diagnostics: Diagnostic | Sequence[Diagnostic]):
        if isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics: list[Diagnostic] = list(diagnostics)
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)


class RunError(Exception):
    """A failure while running a valid spec (NaN loss, out of memory, a bad data file): exit 1."""


def error(message: str, span: Span | None = None, key: str | None = None, hint: str | None = None) -> TesseraError:
    """Shorthand for a TesseraError with one diagnostic."""
    return TesseraError(Diagnostic(message, span=span, key=key, hint=hint))


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """A hint naming the closest valid choice, or None when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else None


def relpath(path: str | Path) -> str:
    """A path as users like to read it: relative to the working directory when below it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
