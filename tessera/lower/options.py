"""`CompileOptions`: what the lowering reads from a spec, typed, built once from the validated experiment.

`compile_experiment` makes one (`CompileOptions.of(exp)`) and the lowering's functions (program, storage,
weights, mesh, sharded steps, pipelines) take it, or the fields they need, instead of the experiment: the
lowering never walks the spec itself. Everything here is a plain value of the spec (defaults filled by its
schema) or a fact derived from one, named for what the lowering does with it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from tessera.diagnostics import Span
from tessera.ir.passes.shard import AxisRules

PROGRAM_SECTIONS = ("model", "mesh", "parallel", "numerics", "kernels")  # spec sections a program's hash covers
PROGRAM_TASK_KEYS = ("kind", "optimizer", "schedule", "microbatches", "steps", "loss_weights")  # steps: the schedule


def _no_span(key: str) -> Span | None:
    return None


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """The spec's settings the lowering reads, typed. Build with `CompileOptions.of(exp)`."""

    # ---- model ---------------------------------------------------------------------------------------------
    model_file: Path
    """The model source (`model.file`); a Hugging Face checkpoint's family is its stem."""
    model_args: Mapping[str, Any]
    """`model.args` as bound (a Hugging Face config is written from them)."""

    # ---- mesh and parallel settings ------------------------------------------------------------------------
    mesh_axes: Mapping[str, int]
    """`mesh`'s axis sizes in mesh order (pp, dp, fsdp, ep, sp, tp), size-1 axes included."""
    rules: AxisRules
    """`parallel.rules` on this mesh (size-1 axes dropped, the stacked layers over pp): what the shard pass
    annotated and the sharded steps split activations by."""
    deterministic: bool
    """`parallel.deterministic`: cross-device reductions in a fixed, mesh-independent order (canonical shards)."""
    canonical_shards: int | None
    """`parallel.canonical_shards`: deterministic mode's shards of a batch (None: the largest divisor up to 8)."""
    canonical_tp: int
    """`parallel.canonical_tp`: deterministic mode's chunks of each tp-split contraction (1: none)."""
    canonical_ep: int
    """`parallel.canonical_ep`: deterministic mode's chunks of every moe op's experts (1: none)."""
    remat: str
    """`parallel.remat`: none | dots | full, the rematerialisation policy of `repeat` bodies."""
    pipeline_schedule: str
    """`parallel.pipeline.schedule`: gpipe | 1f1b (fast mode, pp > 1)."""
    pipeline_microbatches: int
    """`parallel.pipeline.microbatches`: microbatches in flight through the pipeline stages per step."""
    expert_capacity: float | None
    """`parallel.expert_capacity`: the expert-parallel capacity factor (fast mode); None: dropless."""

    # ---- numerics and kernels ------------------------------------------------------------------------------
    numerics: Any
    """`numerics` (tessera.spec.schema.Numerics): default and parameter types, the per-path rules, loss scaling."""
    kernels: str
    """`kernels`: "auto" (fast kernels where they apply, the schema's default) or "reference" (jax.numpy)."""

    # ---- task facts ----------------------------------------------------------------------------------------
    task_kind: str
    """`task.kind`: train | generate | forward | bench."""
    trains: bool
    """Whether the task runs a training step (train, or a bench timing train_step): packed storage is refused."""
    batch: int | None
    """`task.batch` (train, bench), else None: deterministic mode's canonical shards must split over the mesh."""
    seq_len: int | None
    """`task.seq_len` (train, bench), else None: context parallelism's split must divide it."""
    grad_accumulation: int
    """`task.microbatches` of a train task: gradients accumulated over that many slices per step (else 1)."""
    loss_weights: Mapping[str, float]
    """`task.loss_weights`: each named loss term's weight (a term left out weighs 1)."""
    batched_data: bool
    """Whether the task feeds loss entries batches of samples (burgers, sudoku data), which deterministic mode
    cuts into canonical shards (tessera.ir.check_objectives.batched_data)."""
    resample_every: int | None
    """The collocation points' redraw period (`task.data.resample_every`; 0: drawn once), or None when the task's
    data is not collocation points: whether a step's batch can be the last step's (L-BFGS reuses the line
    search's gradient only then)."""
    task_sizes: Mapping[str, int]
    """The task's run-time {"batch", "seq"} (generate: prompts plus new tokens): what the kernel report and
    FLOPs are counted at (tessera.ir.cost.task_dims)."""

    # ---- identity and diagnostics --------------------------------------------------------------------------
    program_fields: tuple[tuple[str, str], ...] = ()
    """The resolved spec's fields that change a compiled program (model, mesh, parallel, numerics, kernels, the
    task's kind, optimizer, schedule, microbatches, steps, loss weights), flattened and sorted: with the graph,
    what programs are cached on (`program_hash`)."""
    locate: Callable[[str], Span | None] = dataclasses.field(default=_no_span, compare=False, repr=False)
    """Where a dotted spec key's value was written (`Experiment.span`): the span a lowering's TesseraError
    points at."""

    @classmethod
    def of(cls, exp) -> "CompileOptions":
        """The options of a validated experiment (every default filled by its schema)."""
        from tessera.ir.check_objectives import batched_data
        from tessera.ir.cost import task_dims
        from tessera.spec.tasks import trains

        task, parallel = exp.task, exp.parallel
        spec = exp.resolved()
        relevant = {k: spec.get(k) for k in PROGRAM_SECTIONS}
        relevant["task"] = {k: v for k, v in spec.get("task", {}).items() if k in PROGRAM_TASK_KEYS}
        batch, seq_len = getattr(task, "batch", None), getattr(task, "seq_len", None)
        data = getattr(task, "data", None)
        resample = int(getattr(data, "resample_every", 0) or 0) if getattr(data, "kind", None) == "collocation" \
            else None
        relevant["task"]["resample_every"] = resample  # compiled into the step (train_step.same_batch)
        return cls(
            model_file=Path(exp.model.file), model_args=MappingProxyType(dict(exp.model.args)),
            mesh_axes=MappingProxyType(dict(exp.mesh.axes)), rules=AxisRules.from_experiment(exp),
            deterministic=bool(parallel.deterministic), canonical_shards=parallel.canonical_shards,
            canonical_tp=int(parallel.canonical_tp or 1) if parallel.deterministic else 1,
            canonical_ep=int(parallel.canonical_ep or 1) if parallel.deterministic else 1, remat=parallel.remat,
            pipeline_schedule=parallel.pipeline.schedule, pipeline_microbatches=int(parallel.pipeline.microbatches),
            expert_capacity=parallel.expert_capacity,
            numerics=exp.numerics, kernels=exp.kernels,
            task_kind=task.kind, trains=trains(task),
            batch=batch if isinstance(batch, int) else None, seq_len=seq_len if isinstance(seq_len, int) else None,
            grad_accumulation=int(getattr(task, "microbatches", 1) or 1),
            loss_weights=MappingProxyType(dict(getattr(task, "loss_weights", None) or {})),
            batched_data=batched_data(exp), resample_every=resample, task_sizes=MappingProxyType(dict(task_dims(exp))),
            program_fields=tuple(sorted(_flatten(relevant).items())), locate=exp.span)

    @property
    def mesh_size(self) -> int:
        """How many devices the mesh spans (the product of its axes)."""
        return math.prod(self.mesh_axes.values())

    @property
    def pp(self) -> int:
        """Pipeline stages (`mesh.pp`)."""
        return int(self.mesh_axes.get("pp", 1))

    def span(self, key: str) -> Span | None:
        """Where the spec wrote dotted `key`'s value (None: not written, or options made without a spec)."""
        return self.locate(key)


def _flatten(d, prefix=""):
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = repr(v)
    return out
