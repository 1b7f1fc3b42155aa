"""The spec contract, swept over the schema: every field of every section set to each value its type admits
(each enum member, the booleans, numbers at and past their bounds, null where allowed) and every model
argument past its bounds, on the tiny GPT-OSS and Llama and on each task kind. `tessera check` either
accepts the spec (exit 0) or refuses it with exit 2 and errors that carry FILE:LINE:COL and the key; never a
traceback, never another exit code. (A one-step run of every accepted variant is the longer sweep's job.)
"""

from __future__ import annotations

import contextlib
import io
import re
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from tessera.cli import main
from tessera.spec import load_experiment
from tessera.spec.schema import Experiment
from tessera.spec.tasks import BenchTask, ForwardTask, GenerateTask, TrainTask

ROOT = Path(__file__).resolve().parents[2]
NUMERIC_TYPES = ["fp32", "bf16", "fp16", "bf16 @accum(fp32)", "fp8_e4m3", "mxfp4", "int8", "bf17", ""]
TASKS = {  # a minimal task of each kind, laid over the tiny spec's
    "train": None,
    "generate": {"kind": "generate", "prompts": ["hi"], "tokenizer": "bytes", "max_new_tokens": 4},
    "forward": {"kind": "forward", "tokens": [[1, 2, 3]]},
    "bench": {"kind": "bench", "batch": 2, "seq_len": 8, "what": ["forward"]},
}
TASK_CLASSES = {"train": TrainTask, "generate": GenerateTask, "forward": ForwardTask, "bench": BenchTask}
SKIP = {"name", "extends", "model.file", "model.args", "parallel.rules", "numerics.rules", "task.kind",
        "task.data.path", "task.tokens_file", "task.out", "checkpoint.dir"}  # free-form text and paths


def _bounds(field) -> tuple[float | None, float | None]:
    lo = hi = None
    for m in field.metadata:
        lo = getattr(m, "ge", None) if getattr(m, "ge", None) is not None else getattr(m, "gt", lo)
        hi = getattr(m, "le", None) if getattr(m, "le", None) is not None else getattr(m, "lt", hi)
    return lo, hi


def _values(annotation, field) -> list:
    """What to try for a field of this type: every member, the bounds and one past each, null if allowed."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return list(args) + ["no_such_value"]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        out = [None] if len(inner) < len(args) else []
        return out + (_values(inner[0], field) if len(inner) == 1 else [])
    if annotation is bool:
        return [True, False, "maybe"]
    if annotation in (int, float):
        lo, hi = _bounds(field)
        near = [v for b in (lo, hi) if b is not None for v in (b, b - 1, b + 1)]
        return sorted(set([0, -1, *near, 10**12]), key=repr)
    if getattr(annotation, "__name__", "") == "Numeric" or "Numeric" in repr(annotation):
        return NUMERIC_TYPES
    return []


def _fields(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for name, field in cls.model_fields.items():
        key = prefix + name
        ann = field.annotation
        if key in SKIP or key == "task":
            continue
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _fields(ann, key + ".")
            continue
        out += [(key, v) for v in _values(ann, field)]
    return out


def _task_fields(kind: str) -> list[tuple[str, object]]:
    return [(k, v) for k, v in _fields(TASK_CLASSES[kind], "task.") if k not in SKIP]


def _spec_file(tmp: Path, base: str, task: dict | None) -> Path:
    """The shipped tiny spec, resolved (every default written out, no `extends`, the model file absolute) and,
    given `task`, with that task instead of its own."""
    spec = load_experiment(ROOT / "specs" / base).resolved()
    spec["model"]["file"] = str(ROOT / "specs" / spec["model"]["file"]) if not Path(
        spec["model"]["file"]).is_absolute() else spec["model"]["file"]
    if task is not None:
        spec["task"] = task
    path = tmp / f"{Path(base).stem}_{(task or {}).get('kind', 'train')}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _model_args(path: Path) -> list[tuple[str, object]]:
    args = yaml.safe_load(path.read_text())["model"]["args"]
    return [(f"model.args.{k}", v) for k, v in args.items() if isinstance(v, int) and not isinstance(v, bool)
            for v in (0, -1)]


POSITION = re.compile(r"^\S+:\d+:\d+: error: ", re.M)


def _check(spec: Path, key: str, value, refuse: bool = False) -> str | None:
    """None if `check` keeps the contract for spec + (key = value), else what went wrong; `refuse`: the value
    is out of range, so accepting it breaks the contract too."""
    setting = f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["check", str(spec), "--set", setting])
    except SystemExit as exc:  # argparse
        return f"--set {setting}: SystemExit {exc.code}"
    except Exception as exc:  # the contract's breach: a traceback would reach the user
        return f"--set {setting}: {type(exc).__name__}: {exc}"
    text = err.getvalue()
    if code == 0:
        return f"--set {setting}: accepted, but it is out of range" if refuse else None
    if code != 2:
        return f"--set {setting}: exit {code}: {text[:300]}"
    errors = [line for line in text.splitlines() if ": error: " in line]
    if not errors or not all(POSITION.match(line) for line in errors):
        return f"--set {setting}: an error without FILE:LINE:COL: {text[:300]}"
    return None


CASES = [("gpt_oss_tiny.yaml", None), ("llama_tiny.yaml", None)] + [("gpt_oss_tiny.yaml", k) for k in TASKS
                                                                   if k != "train"]


@pytest.mark.parametrize("base,kind", CASES)
def test_check_keeps_the_contract_for_every_schema_value(tmp_path, base, kind):
    spec = _spec_file(tmp_path, base, TASKS[kind] if kind else None)
    if kind is None:  # the sections other than the task, the model's arguments and the train task's fields
        settings = _fields(Experiment) + _model_args(spec) + _task_fields("train")
    else:
        settings = _task_fields(kind)
    assert settings
    assert main(["check", str(spec)]) == 0  # the base itself is valid: a refusal below is the setting's
    sizes = set(_model_args(spec))  # every integer argument of these models is a size: 0 and -1 are refused
    broken = [why for key, value in settings if (why := _check(spec, key, value, (key, value) in sizes)) is not None]
    assert not broken, f"{len(broken)} of {len(settings)} settings break the contract:\n" + "\n".join(broken)
