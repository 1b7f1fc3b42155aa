"""The experiment spec as Pydantic models: model, mesh, parallel, numerics, task, checkpoint.

Every model is frozen and closed (`extra="forbid"`); every field has a description. Validators
check, they never rewrite: the loader (load.py) fills derived values before validation.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator, PrivateAttr, field_validator, model_validator

from tessera.diagnostics import Span, did_you_mean
from tessera.grammar.numerics import NumericType, parse
from tessera.spec.fields import FilePath, Name, Numeric, Section, fail
from tessera.spec.tasks import Task

MESH_AXES = ("pp", "dp", "fsdp", "ep", "sp", "tp")  # outermost to innermost
LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts", "vocab", "layers")
DEFAULT_RULES: dict[str, str | list[str] | None] = {
    "batch": ["dp", "fsdp"], "embed": "fsdp", "heads": "tp", "kv_heads": "tp", "mlp": "tp", "vocab": "tp",
    "experts": "ep", "seq": "sp",
}
PARAM_TYPES = ("fp32", "bf16", "fp16", "fp64")  # master weights are kept in a plain float type


class Model(Section):
    """Which model-language file defines the architecture, and the arguments it is instantiated with."""

    file: FilePath = Field(description="the model file (.tsl); relative paths resolve against the spec file")
    args: dict[str, Any] = Field(default_factory=dict, description="arguments of the model, by name")

    @field_validator("args")
    @classmethod
    def _plain_args(cls, args: dict[str, Any]) -> dict[str, Any]:
        for name, value in args.items():
            items = value if isinstance(value, list) else [value]
            if not all(v is None or isinstance(v, (bool, int, float, str)) for v in items):
                raise fail("model_arg", "model arguments are numbers, strings, booleans or lists of them",
                           at=(name,))
        return args


class Mesh(Section):
    """Device-mesh axis sizes; their product is the number of devices. Axes of size 1 cost nothing."""

    pp: int = Field(1, ge=1, description="pipeline-parallel stages")
    dp: int = Field(1, ge=1, description="data-parallel replicas")
    fsdp: int = Field(1, ge=1, description="fully-sharded data parallel (parameters sharded, gathered per layer)")
    ep: int = Field(1, ge=1, description="expert-parallel groups")
    sp: int = Field(1, ge=1, description="sequence (context) parallel shards")
    tp: int = Field(1, ge=1, description="tensor-parallel shards")
    auto: bool = Field(False, description="`mesh: auto`: `tessera run` picks the axes from the devices present and "
                       "the plan's memory model (fewest model-parallel devices that fit, the rest data parallel) and "
                       "records them beside `auto: true`, which lets the mesh use fewer devices than are present; "
                       "`--set mesh.<axis>=N` makes the mesh explicit")

    @model_validator(mode="before")
    @classmethod
    def _auto(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value != "auto":
                raise fail("mesh", f"`mesh: {value}` is neither `auto` nor a mapping of axis sizes",
                           hint="write `mesh: auto`, or e.g. `mesh: {tp: 8}`")
            return {"auto": True}
        return value

    @property
    def axes(self) -> dict[str, int]:
        """Axis sizes in mesh order: pp, dp, fsdp, ep, sp, tp."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    @property
    def size(self) -> int:
        """Number of devices the mesh spans."""
        size = 1
        for n in self.axes.values():
            size *= n
        return size


def _axis_rule(value: Any) -> str | list[str] | None:
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    for i, axis in enumerate(items):
        at = (i,) if isinstance(value, list) else ()
        if not isinstance(axis, str) or axis not in MESH_AXES:
            raise fail("mesh_axis", f"unknown mesh axis `{axis}`; expected one of {', '.join(MESH_AXES)} or null",
                       at=at, hint=did_you_mean(str(axis), MESH_AXES))
        if axis in items[:i]:
            raise fail("mesh_axis", f"mesh axis `{axis}` is listed twice", at=at)
    return value


AxisRule = Annotated[Any, PlainValidator(_axis_rule)]


def _logical_axis(name: Any) -> str:
    if name not in LOGICAL_AXES:
        raise fail("logical_axis", f"unknown logical axis `{name}`; expected one of " + ", ".join(LOGICAL_AXES),
                   hint=did_you_mean(str(name), LOGICAL_AXES))
    return name


LogicalAxis = Annotated[str, PlainValidator(_logical_axis)]


class Pipeline(Section):
    """Pipeline parallelism over the `pp` mesh axis."""

    microbatches: int = Field(1, ge=1, description="microbatches in flight through the pipeline per step")
    schedule: Literal["gpipe", "1f1b"] = Field("gpipe", description="gpipe | 1f1b")


class Parallel(Section):
    """How logical tensor axes map onto mesh axes, and the parallel execution options."""

    rules: dict[LogicalAxis, AxisRule] = Field(
        default_factory=lambda: dict(DEFAULT_RULES),
        description="logical axis -> mesh axis, list of mesh axes, or null (replicated); logical axes not "
                    "listed keep their default mapping")
    pipeline: Pipeline = Field(default_factory=Pipeline, description="pipeline microbatches and schedule")
    sequence_parallel: bool = Field(False, description="shard activations along seq between tensor-parallel ops")
    remat: Literal["none", "dots", "full"] = Field(
        "none", description="rematerialisation: none (save every op's results) | dots (save matmul outputs only) | "
        "full")
    deterministic: bool = Field(True, description="fixed-order reductions: bitwise-reproducible on any mesh")
    canonical_shards: int | None = Field(
        None, ge=1, description="deterministic mode: the batch is cut into this many canonical shards (a divisor of "
        "task.batch) whose gradients are summed in one fixed tree; any mesh whose device count divides it "
        "reproduces the one-device run bit for bit. null: the largest divisor of the batch up to 8. Ignored in "
        "fast mode")
    canonical_tp: int | None = Field(
        None, ge=1, description="deterministic mode: the contractions tensor parallelism splits (attention's output "
        "projection over heads, the MLP's down projection over its hidden dim, and the gradients of their inputs) "
        "are computed as this many chunks summed in one fixed tree (a power of two) on every mesh, one device "
        "included; a mesh whose tp divides it then splits those layers' compute over tp. null or 1: no chunks, tp "
        "acts as a data axis. It changes the one-device numbers, like canonical_shards. Ignored in fast mode")
    canonical_ep: int | None = Field(
        None, ge=1, description="deterministic mode: the experts of every moe op are cut into this many canonical "
        "chunks (a power of two dividing the experts), each chunk's grouped products computed on their own on every "
        "mesh, one device included; a mesh whose ep divides it then splits the experts' compute over ep. null or 1: "
        "no chunks, ep acts as a data axis. With canonical_tp too, each chunk's hidden dim is cut into tp's chunks "
        "inside it. It changes the one-device numbers, like canonical_shards. Ignored in fast mode")
    expert_capacity: float | None = Field(
        None, gt=0, description="expert parallel capacity factor (fast mode): each destination shard receives at "
        "most ceil(factor · T·k / ep) copies from each source device routing T tokens; copies beyond it are "
        "dropped and counted (metric moe_dropped). null: dropless. Ignored with ep=1 and in deterministic mode")


_LOSS_SCALE_HELP = "expected none, dynamic or static(<positive number>), e.g. static(1024)"


def _loss_scale(value: Any) -> str:
    if value in ("none", "dynamic"):
        return value
    if isinstance(value, str) and value.startswith("static(") and value.endswith(")"):
        try:
            if float(value[7:-1]) > 0:
                return value
        except ValueError:
            pass
    raise fail("loss_scale", f"{_LOSS_SCALE_HELP}; got `{value}`")


class Numerics(Section):
    """Numeric types: the default for compute, the master weights, and per-parameter rules."""

    default: Numeric = Field(default_factory=lambda: parse("fp32"),
                             description="type of activations and matmuls, e.g. `bf16 @accum(fp32)`")
    params: Numeric = Field(default_factory=lambda: parse("fp32"), description="type of the master weights")
    rules: dict[str, Numeric] = Field(
        default_factory=dict, description="glob on parameter path -> storage type; applied in order, last match wins")
    compute: dict[str, Numeric] = Field(
        default_factory=dict, description="glob on an op's path (as profiles name it: layers/attention, embed/unembed) "
        "-> the type its products with weights compute in: the fp8 default's type to put the unembedding in fp8, or "
        "the program's compute type (bf16) to keep an op out of it; applied in order, last match wins")
    loss_scale: Annotated[str, PlainValidator(_loss_scale)] = Field(
        "none", description="loss scaling for low-precision training: none | dynamic | static(<float>)")

    def match(self, path: str) -> NumericType | None:
        """The type the LAST rule whose glob matches `path` gives (fnmatch: `*` crosses `/`), or None."""
        found = None
        for glob, numeric in self.rules.items():
            if fnmatch.fnmatchcase(path, glob):
                found = numeric
        return found

    @field_validator("params")
    @classmethod
    def _plain_float(cls, value: NumericType) -> NumericType:
        if value.base not in PARAM_TYPES or value != NumericType(value.base):
            raise fail("param_type", f"master weights must be one of {', '.join(PARAM_TYPES)} without modifiers; "
                       f"got `{value}`", hint="store low-precision weights with numerics.rules instead")
        return value


class Checkpoint(Section):
    """Where and how often training writes checkpoints."""

    dir: str = Field("ckpt/", description="checkpoint directory, relative to the run directory")
    every: int = Field(0, ge=0, description="save every this many steps; 0 saves only at the end")
    keep: int = Field(3, ge=1, description="how many recent checkpoints to keep")


def _key_path(key: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in key.replace("[", ".").replace("]", "").split("."))


class Experiment(Section):
    """A whole experiment: what model, on what mesh, in what numbers, doing which task."""

    name: Name = Field(description="the experiment's name (defaults to the spec file's name); names run directories")
    extends: str | None = Field(None, exclude=True, description="a base spec (relative path) this one deep-merges "
                                "onto; consumed by the loader")
    model: Model = Field(description="the model file and its arguments")
    mesh: Mesh = Field(default_factory=Mesh, description="device-mesh axis sizes")
    parallel: Parallel = Field(default_factory=Parallel, description="sharding rules and parallel options")
    numerics: Numerics = Field(default_factory=Numerics, description="numeric types")
    kernels: Literal["auto", "reference"] = Field(
        "auto", description="auto: use fast kernels where they apply; reference: plain jax.numpy everywhere")
    task: Task = Field(description="what to do: train | generate | forward | bench (keyed by `kind`)")
    checkpoint: Checkpoint = Field(default_factory=Checkpoint, description="checkpointing")

    _spans: dict[tuple, Span] = PrivateAttr(default_factory=dict)
    _key_spans: dict[tuple, Span] = PrivateAttr(default_factory=dict)

    def span(self, key: str) -> Span | None:
        """Where the value at dotted `key` (e.g. "model.args.heads", "task.prompts.0") was written."""
        return self._spans.get(_key_path(key))

    def key_span(self, key: str) -> Span | None:
        """Where the key naming dotted `key` was written (an unknown name is wrong there), else its value's span."""
        path = _key_path(key)
        return self._key_spans.get(path) or self._spans.get(path)

    def resolved(self) -> dict[str, Any]:
        """The resolved spec as plain data, every default filled (what manifests record)."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        """The resolved spec as YAML; itself a valid spec."""
        from tessera.spec.dump import dump_yaml

        return dump_yaml(self.resolved())

    @property
    def spec_hash(self) -> str:
        """sha256 of the canonical (sorted-key JSON) resolved spec, named files by content rather than path."""
        from tessera.spec.files import portable

        text = json.dumps(portable(self.resolved()), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

