"""Per-step metrics: `metrics.jsonl` (one JSON object a line, appended) and TensorBoard event files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

import jax

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


class MetricsLog:
    """Appends records to metrics.jsonl and scalars to TensorBoard (through tensorboardX)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = Path(run_dir) / METRICS_FILE
        self._writer = None
        self.enabled = jax.process_index() == 0  # one writer when several processes run the same spec
        if tensorboard and self.enabled:
            from tensorboardX import SummaryWriter  # imported here: it is slow to import and optional

            self._writer = SummaryWriter(logdir=str(Path(run_dir) / TB_DIR))

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (after resuming from a checkpoint at `step`, they will be redone)."""
        if not self.path.exists() or not self.enabled:
            return
        keep = [line for line in self.path.read_text().splitlines() if line.strip()
                and json.loads(line).get("step", -1) <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        """Append records (each with a `step`) to the file, then to TensorBoard."""
        records = list(records)
        if not records or not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
            fh.flush()
        if self._writer is not None:
            for rec in records:
                for key, value in rec.items():
                    if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                        self._writer.add_scalar(key, value, rec["step"])
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        if self._writer is not None:
            self._writer.close()
