"""The Experiment API other layers build on: fields, defaults, overrides, spans, resolved YAML, hash."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tessera.diagnostics import TesseraError
from tessera.grammar.numerics import parse
from tessera.spec import DEFAULT_RULES, Experiment, load_experiment
from tessera.spec.tasks import BenchTask, ForwardTask, GenerateTask, TrainTask

from .conftest import VALID


@pytest.fixture
def spec(spec_dir: Path) -> Path:
    path = spec_dir / "s.yaml"
    path.write_text(VALID)
    return path


def test_fields_and_defaults(spec: Path) -> None:
    exp = load_experiment(spec)
    assert isinstance(exp, Experiment) and exp.name == "t"
    assert exp.model.file == (spec.parent / "model.tsl").resolve() and exp.model.file.is_absolute()
    assert exp.model.args["heads"] == 8
    assert exp.mesh.axes == {"pp": 1, "dp": 2, "fsdp": 1, "ep": 1, "sp": 1, "tp": 2}
    assert list(exp.mesh.axes) == ["pp", "dp", "fsdp", "ep", "sp", "tp"] and exp.mesh.size == 4
    assert exp.parallel.rules == DEFAULT_RULES  # the spec names two rules; the others keep their default
    assert exp.parallel.pipeline.microbatches == 1 and exp.parallel.pipeline.schedule == "gpipe"
    assert exp.parallel.remat == "dots" and exp.parallel.deterministic is True
    assert exp.numerics.default == parse("bf16 @accum(fp32)") and exp.numerics.params == parse("fp32")
    assert exp.numerics.rules == {"*/moe/experts/*": parse("mxfp4")} and exp.numerics.loss_scale == "none"
    assert exp.kernels == "auto"
    assert isinstance(exp.task, TrainTask) and exp.task.optimizer.lr == 1e-3 and exp.task.microbatches == 1
    assert exp.task.data.kind == "synthetic" and exp.task.data.task == "copy" and exp.task.sample is None
    assert (exp.checkpoint.dir, exp.checkpoint.every, exp.checkpoint.keep) == ("ckpt/", 5, 3)


def test_frozen(spec: Path) -> None:
    exp = load_experiment(spec)
    with pytest.raises(Exception):
        exp.mesh.tp = 8  # type: ignore[misc]


def test_overrides_list_and_dict(spec: Path) -> None:
    a = load_experiment(spec, overrides=["mesh.tp=4", "mesh.dp=1", "task.steps=3", "parallel.rules.heads=null",
                                         "numerics.default=fp16 @loss_scale(dynamic)"])
    b = load_experiment(spec, overrides={"mesh.tp": 4, "mesh.dp": 1, "task.steps": 3, "parallel.rules.heads": None,
                                         "numerics.default": "fp16 @loss_scale(dynamic)"})
    assert a.resolved() == b.resolved()
    assert a.mesh.tp == 4 and a.task.steps == 3 and a.parallel.rules["heads"] is None
    assert a.numerics.default.loss_scale == "dynamic"


def test_override_values_are_yaml(spec: Path) -> None:
    exp = load_experiment(spec, overrides=["parallel.rules.batch=[dp]", "task.optimizer.lr=1e-2",
                                           "task.sample={prompt: hi, max_new_tokens: 4}"])
    assert exp.parallel.rules["batch"] == ["dp"] and exp.task.optimizer.lr == 0.01
    assert exp.task.sample is not None and exp.task.sample.prompt == "hi"


def test_override_task_mapping_merges(spec: Path) -> None:
    with pytest.raises(TesseraError) as info:  # mappings merge, so the train fields stay and are now unknown
        load_experiment(spec, overrides=["task={kind: bench, batch: 4}"])
    assert "s.yaml:15:3: error: task.steps: unknown key `steps`" in info.value.render()


def test_spans(spec: Path) -> None:
    exp = load_experiment(spec, overrides=["mesh.tp=4"])
    span = exp.span("model.args.heads")
    assert span is not None and (span.line, span.col) == (4, 53) and span.file == "s.yaml"
    assert exp.span("task.optimizer.lr").line == 17
    assert exp.span("parallel.rules.batch[1]").col == 23
    tp = exp.span("mesh.tp")
    assert (tp.file, tp.line, tp.col, tp.text) == ("<--set>", 1, 9, "mesh.tp=4")
    assert exp.span("task.eval_every") is None  # a default: written nowhere
    assert exp.span("parallel.rules.vocab") is None and exp.span("parallel.rules.heads") is not None


def test_resolved_yaml_is_a_valid_spec(spec: Path, spec_dir: Path) -> None:
    exp = load_experiment(spec, overrides=["task.sample={prompt: '1e-3', max_new_tokens: 4}"])
    text = exp.to_yaml()
    data = yaml.safe_load(text)
    assert data["task"]["eval_batches"] == 4 and data["checkpoint"]["keep"] == 3  # every default is filled
    assert "extends" not in data and data["numerics"]["default"] == "bf16 @accum(fp32)"
    again_path = spec_dir / "sub" / "resolved.yaml"
    again_path.parent.mkdir()
    again_path.write_text(text)
    again = load_experiment(again_path)
    assert again.resolved() == exp.resolved() and again.spec_hash == exp.spec_hash
    assert again.task.sample.prompt == "1e-3"  # a string that looks like a number stays a string


def test_spec_hash_tracks_content(spec: Path) -> None:
    a, b = load_experiment(spec), load_experiment(spec)
    assert a.spec_hash == b.spec_hash and len(a.spec_hash) == 64
    assert load_experiment(spec, overrides=["task.steps=11"]).spec_hash != a.spec_hash


def test_name_defaults_to_file_stem(spec_dir: Path) -> None:
    path = spec_dir / "my_run.yaml"
    path.write_text(VALID.replace("name: t\n", ""))
    exp = load_experiment(path)
    assert exp.name == "my_run" and exp.span("name") is None


def test_extends_deep_merge(spec_dir: Path) -> None:
    (spec_dir / "base").mkdir()
    (spec_dir / "base" / "b.yaml").write_text(
        "model:\n  file: ../model.tsl\n  args: {vocab: 256, heads: 8}\nmesh: {tp: 2}\n"
        "task: {kind: train, steps: 5, optimizer: {lr: 0.5}}\n")
    (spec_dir / "c.yaml").write_text("extends: base/b.yaml\nmodel:\n  args: {heads: 4}\ntask: {optimizer: {b1: 0.8}}\n")
    exp = load_experiment(spec_dir / "c.yaml")
    assert exp.model.args == {"vocab": 256, "heads": 4}  # child wins, siblings kept
    assert exp.model.file == (spec_dir / "model.tsl").resolve()  # relative to the file that wrote it
    assert exp.task.optimizer.lr == 0.5 and exp.task.optimizer.b1 == 0.8 and exp.mesh.tp == 2
    assert exp.span("model.args.vocab").file == "base/b.yaml" and exp.span("model.args.heads").file == "c.yaml"


def test_other_task_kinds(spec_dir: Path) -> None:
    head = "model: {file: model.tsl, args: {vocab: 300}}\n"
    cases = {
        "g": ("task: {kind: generate, prompts: [hello, [1, 299]], sampling: {temperature: 0.7, top_k: 5}}",
              GenerateTask),
        "f": ("task: {kind: forward, tokens: [[1, 2], [3, 4]]}", ForwardTask),
        "b": ("task: {kind: bench, what: [forward, decode]}", BenchTask),
    }
    for name, (task, cls) in cases.items():
        (spec_dir / f"{name}.yaml").write_text(head + task + "\n")
        exp = load_experiment(spec_dir / f"{name}.yaml")
        assert isinstance(exp.task, cls) and exp.task.kind == cls.model_fields["kind"].annotation.__args__[0]
    g = load_experiment(spec_dir / "g.yaml").task
    assert g.prompts == ["hello", [1, 299]] and g.tokenizer == "bytes" and g.sampling.top_p == 1.0


def test_every_field_has_a_description() -> None:
    from pydantic import BaseModel

    import tessera.spec as spec_pkg

    models = [v for v in vars(spec_pkg).values() if isinstance(v, type) and issubclass(v, BaseModel)]
    assert len(models) >= 15
    for model in models:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_set_task_kind_switches_kinds() -> None:
    """`--set task.kind=...` replaces the old kind's own fields; shared ones stay; missing ones are reported."""
    root = Path(__file__).resolve().parents[2] / "specs"
    exp = load_experiment(root / "gpt_oss_tiny.yaml",
                          overrides=["task.seed=7", "task.kind=generate", "task.prompts=[[1, 2, 3]]"])
    assert isinstance(exp.task, GenerateTask) and exp.task.prompts == [[1, 2, 3]] and exp.task.seed == 7
    with pytest.raises(TesseraError) as err:
        load_experiment(root / "gpt_oss_tiny.yaml", overrides=["task.kind=generate"])
    assert [(d.key, d.message) for d in err.value.diagnostics] == [("task.prompts", "missing required key `prompts`")]
    data = load_experiment(root / "gpt_oss_tiny.yaml", overrides=["task.data.kind=tokens", "task.data.path=" +
                                                                   str(root / "gpt_oss_tiny.yaml")])
    assert data.task.data.kind == "tokens"
