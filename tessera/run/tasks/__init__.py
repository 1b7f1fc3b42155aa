"""Tasks by `task.kind`: each is `run(ctx: RunContext) -> int` (an exit code) that fills the manifest."""

from __future__ import annotations

from typing import Callable

from tessera.run.tasks import bench, forward, generate, train

TASKS: dict[str, Callable] = {
    "train": train.run,
    "generate": generate.run,
    "forward": forward.run,
    "bench": bench.run,
}
