"""Broken specs through `tessera check`: exit code 2, exact FILE:LINE:COL, key path, gist, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera import cli

# Line numbers below refer to this spec (plus what a case appends from line 8 on).
MINI = """\
name: t
model:
  file: model.tsl
  args: {vocab: 256, heads: 4, kv_heads: 2, layers: 2}
task:
  kind: train
  steps: 10
"""


def gen(extra: str = "") -> str:
    """A generate task (prompts on line 7) instead of train."""
    return MINI.replace("kind: train", "kind: generate").replace("  steps: 10\n", "  prompts: [hi]\n") + extra


# (id, spec text, --set overrides, extra files, [(where, key path, gist), ...])
CASES = [
    # typos at every nesting level
    ("typo-top", MINI + "mesh_: {tp: 1}\n", [], {}, [("s.yaml:8:1", "mesh_", "unknown key `mesh_`; did you mean `mesh`?")]),
    ("typo-task", MINI + "  microbatch: 2\n", [], {}, [("s.yaml:8:3", "task.microbatch", "did you mean `microbatches`?")]),
    ("typo-optimizer", MINI + "  optimizer: {nmae: adam}\n", [], {},
     [("s.yaml:8:15", "task.optimizer.nmae", "did you mean `name`?")]),
    ("typo-pipeline", MINI + "parallel:\n  pipeline: {microbatch: 4}\n", [], {},
     [("s.yaml:9:14", "parallel.pipeline.microbatch", "did you mean `microbatches`?")]),
    ("typo-model", MINI.replace("  args:", "  arg:"), [], {}, [("s.yaml:4:3", "model.arg", "did you mean `args`?")]),
    ("typo-sampling", gen("  sampling: {temprature: 0.5}\n"), [], {},
     [("s.yaml:8:14", "task.sampling.temprature", "did you mean `temperature`?")]),
    ("typo-in-base", "extends: base.yaml\n" + MINI, [], {"base.yaml": "mesh:\n  tpp: 2\n"},
     [("base.yaml:2:3", "mesh.tpp", "did you mean `tp`?")]),
    ("key-of-other-kind", MINI + "  prompts: [hi]\n", [], {}, [("s.yaml:8:3", "task.prompts", "unknown key `prompts`")]),
    # wrong types
    ("str-for-int", MINI.replace("steps: 10", "steps: ten"), [], {},
     [("s.yaml:7:10", "task.steps", 'expected an integer, got "ten"')]),
    ("float-for-int", MINI + "mesh: {tp: 2.5}\n", [], {}, [("s.yaml:8:12", "mesh.tp", "expected an integer, got 2.5")]),
    ("bool-for-int", MINI + "  batch: true\n", [], {}, [("s.yaml:8:10", "task.batch", "expected an integer, got true")]),
    ("yes-is-not-bool", MINI + "parallel: {deterministic: yes}\n", [], {},
     [("s.yaml:8:27", "parallel.deterministic", 'expected true or false, got "yes"')]),
    ("sexagesimal-is-str", MINI + "  seq_len: 1:30\n", [], {},
     [("s.yaml:8:12", "task.seq_len", 'expected an integer, got "1:30"')]),
    ("mapping-for-section", MINI + "mesh: 8\n", [], {}, [("s.yaml:8:7", "mesh", "expected a mapping, got 8")]),
    ("list-for-str", MINI + "checkpoint: {dir: [a]}\n", [], {},
     [("s.yaml:8:19", "checkpoint.dir", "expected a string, got a list")]),
    ("literal", MINI + "parallel: {remat: dot}\n", [], {},
     [("s.yaml:8:19", "parallel.remat", 'expected one of none, dots, full, got "dot"; did you mean `dots`?')]),
    ("synthetic-task", MINI + "  data: {task: revers}\n", [], {},
     [("s.yaml:8:16", "task.data.task", "did you mean `reverse`?")]),
    ("model-arg-mapping", MINI.replace("layers: 2}", "layers: {a: 1}}"), [], {},
     [("s.yaml:4:45", "model.args.layers", "model arguments are numbers")]),
    # negative or zero sizes
    ("zero-mesh", MINI + "mesh: {dp: 0}\n", [], {}, [("s.yaml:8:12", "mesh.dp", "must be >= 1, got 0")]),
    ("negative-steps", MINI.replace("steps: 10", "steps: -5"), [], {},
     [("s.yaml:7:10", "task.steps", "must be >= 1, got -5")]),
    ("zero-lr", MINI + "  optimizer: {lr: 0}\n", [], {}, [("s.yaml:8:19", "task.optimizer.lr", "must be > 0")]),
    ("top-p", gen("  sampling: {top_p: 1.5}\n"), [], {}, [("s.yaml:8:21", "task.sampling.top_p", "must be <= 1")]),
    ("empty-prompts", gen().replace("prompts: [hi]", "prompts: []"), [], {},
     [("s.yaml:7:12", "task.prompts", "at least 1 item")]),
    ("negative-token", gen().replace("prompts: [hi]", "prompts: [[1, -2]]"), [], {},
     [("s.yaml:7:17", "task.prompts[0][1]", "token ids are integers >= 0")]),
    ("nan", MINI + "  optimizer: {lr: .nan}\n", [], {}, [("s.yaml:8:19", "task.optimizer.lr", "finite number")]),
    # numeric types and modifiers
    ("unknown-dtype", MINI + "numerics: {default: bf17}\n", [], {},
     [("s.yaml:8:21", "numerics.default", "unknown numeric type `bf17`; expected one of")]),
    ("unknown-modifier", MINI + "numerics:\n  default: bf16 @acum(fp32)\n", [], {},
     [("s.yaml:9:17", "numerics.default", "unknown modifier `@acum`")]),
    ("quoted-modifier", MINI + 'numerics:\n  default: "fp8_e4m3 @scale(per_block(0))"\n', [], {},
     [("s.yaml:9:39", "numerics.default", "block size must be a positive integer")]),
    ("bad-accum", MINI + "numerics:\n  rules: {'*/q': bf16 @accum(int8)}\n", [], {},
     [("s.yaml:9:30", "numerics.rules.*/q", "cannot accumulate in `int8`")]),
    ("params-block", MINI + "numerics: {params: mxfp4}\n", [], {},
     [("s.yaml:8:20", "numerics.params", "master weights must be one of fp32, bf16, fp16")]),
    ("loss-scale", MINI + "numerics: {loss_scale: static(-4)}\n", [], {},
     [("s.yaml:8:24", "numerics.loss_scale", "expected none, dynamic or static(")]),
    # task kinds
    ("kind-typo", MINI.replace("kind: train", "kind: trian"), [], {},
     [("s.yaml:6:9", "task.kind", 'unknown kind "trian"'), ]),
    ("kind-missing", MINI.replace("  kind: train\n", ""), [], {}, [("s.yaml:5:1", "task.kind", "missing required key `kind`")]),
    ("model-missing", "name: t\ntask: {kind: bench}\n", [], {}, [("s.yaml:1:1", "model", "missing required key `model`")]),
    ("data-kind", MINI + "  data: {kind: tokenz, path: x}\n", [], {},
     [("s.yaml:8:16", "task.data.kind", "did you mean `tokens`?")]),
    ("forward-both", MINI.replace("kind: train", "kind: forward").replace("steps: 10", "out: x.npy"), [], {},
     [("s.yaml:5:1", "task", "give exactly one of `tokens` and `tokens_file`")]),
    # parallel rules
    ("mesh-axis", MINI + "parallel:\n  rules: {heads: tpp}\n", [], {},
     [("s.yaml:9:18", "parallel.rules.heads", "unknown mesh axis `tpp`")]),
    ("logical-axis", MINI + "parallel:\n  rules: {head: tp}\n", [], {},
     [("s.yaml:9:11", "parallel.rules.head", "unknown logical axis `head`")]),
    ("axis-twice", MINI + "parallel:\n  rules: {batch: [dp, dp]}\n", [], {},
     [("s.yaml:9:23", "parallel.rules.batch[1]", "listed twice")]),
    # checks across sections
    ("tp-divides-heads", MINI + "mesh: {tp: 3}\n", [], {},
     [("s.yaml:4:17", "model.args.vocab", "tp=3 does not divide vocab=256"),
      ("s.yaml:4:29", "model.args.heads", "tp=3 does not divide heads=4"),
      ("s.yaml:4:42", "model.args.kv_heads", "tp=3 does not divide kv_heads=2")]),
    ("batch-split", MINI + "  batch: 6\n  microbatches: 4\n", [], {},
     [("s.yaml:8:10", "task.batch", "does not split into microbatches=4")]),
    ("token-vocab", gen().replace("prompts: [hi]", "prompts: [[1, 999]]"), [], {},
     [("s.yaml:7:17", "task.prompts[0][1]", "token id 999 is outside the vocabulary")]),
    ("text-without-tokenizer", gen("  tokenizer: none\n"), [], {},
     [("s.yaml:7:13", "task.prompts[0]", "needs `tokenizer: bytes`")]),
    ("model-file-missing", MINI.replace("model.tsl", "nope.tsl"), [], {},
     [("s.yaml:3:9", "model.file", "no such file")]),
    # --set
    ("set-no-equals", MINI, ["mesh.tp"], {}, [("<--set>:1:1", None, "expected KEY=VALUE")]),
    ("set-empty-segment", MINI, ["mesh..tp=2"], {}, [("<--set>:1:6", "mesh..tp", "empty key segment")]),
    ("set-bad-value", MINI, ["mesh.tp=4", "task.steps=abc"], {},
     [("<--set>:2:12", "task.steps", 'expected an integer, got "abc"')]),
    ("set-unknown-key", MINI, ["task.optimizer.lrr=0.1"], {},
     [("<--set>:1:16", "task.optimizer.lrr", "did you mean `lr`?")]),
    ("set-yaml-error", MINI, ["parallel.rules.batch=[dp"], {}, [("<--set>:1:22", None, "flow sequence is not closed")]),
    ("set-into-scalar", MINI, ["task.steps.x=1"], {}, [("<--set>:1:12", "task.steps", "is not a mapping")]),
    ("set-extends", MINI, ["extends=a.yaml"], {}, [("<--set>:1:1", "extends", "cannot be overridden")]),
    # extends
    ("extends-cycle", "extends: a.yaml\n" + MINI, [], {"a.yaml": "extends: s.yaml\n"},
     [("a.yaml:1:10", "extends", "extends cycle: s.yaml -> a.yaml -> s.yaml")]),
    ("extends-missing", "extends: base/none.yaml\n" + MINI, [], {}, [("s.yaml:1:10", "extends", "no such file")]),
    ("extends-escapes", "extends: ../outside.yaml\n" + MINI, [], {}, [("s.yaml:1:10", "extends", "outside the spec's directory")]),
    ("extends-absolute", "extends: /etc/passwd\n" + MINI, [], {}, [("s.yaml:1:10", "extends", "not an absolute path")]),
    ("extends-not-str", "extends: [a.yaml]\n" + MINI, [], {}, [("s.yaml:1:10", "extends", "expected a relative path")]),
    # YAML itself
    ("duplicate-key", MINI + "  steps: 20\n", [], {}, [("s.yaml:8:3", None, "duplicate key `steps`; first given at line 7")]),
    ("duplicate-top", MINI + "name: u\n", [], {}, [("s.yaml:8:1", None, "duplicate key `name`")]),
    ("syntax", MINI + "mesh: {tp: 2\n", [], {}, [("s.yaml:8:7", None, "YAML syntax error: this flow mapping is not closed")]),
    ("unclosed-last-line", MINI + "oops: [1, 2", [], {}, [("s.yaml:8:7", None, "this flow sequence is not closed")]),
    ("unclosed-quote", MINI + 'name: "t\n', [], {}, [("s.yaml:8:7", None, "this quoted scalar is not closed")]),
    ("bad-indent", MINI.replace("  steps", "   steps"), [], {}, [("s.yaml:7:9", None, "YAML syntax error")]),
    ("tab", MINI.replace("  steps", "\tsteps"), [], {}, [("s.yaml:7:1", None, "tab character")]),
    ("empty", "", [], {}, [("s.yaml:1:1", None, "the spec is empty")]),
    ("comments-only", "# nothing\n", [], {}, [("s.yaml:1:1", None, "the spec is empty")]),
    ("list-root", "- a\n- b\n", [], {}, [("s.yaml:1:1", None, "must be a mapping")]),
    ("scalar-root", "hello\n", [], {}, [("s.yaml:1:1", None, "must be a mapping")]),
    ("python-tag", MINI + "mesh: !!python/object:os.system {}\n", [], {}, [("s.yaml:8:7", None, "unsupported YAML tag")]),
    ("two-documents", MINI + "---\nname: u\n", [], {}, [("s.yaml:8:1", None, "single document")]),
    ("deep-nesting", "a: " + "[" * 500 + "]" * 500 + "\n", [], {}, [("s.yaml:1:103", None, "nesting deeper than 100")]),
    # a path under a home directory this machine does not have (found by test_property's mutations)
    ("unknown-user-home", MINI.replace("file: model.tsl", "file: ~no-such-user-x/model.tsl"), [], {},
     [("s.yaml:3:9", "model.file", "cannot expand `~no-such-user-x`: no such user or home directory")]),
    ("alias-bomb", "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdef", "bcdefg")), [], {},
     [("s.yaml:", None, "expands to more than 100000 values")]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_broken_spec(spec_dir: Path, capsys: pytest.CaptureFixture, case) -> None:
    _, text, overrides, files, expected = case
    (spec_dir / "s.yaml").write_text(text)
    for name, content in files.items():
        (spec_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (spec_dir / name).write_text(content)
    argv = ["check", "s.yaml"] + [a for o in overrides for a in ("--set", o)]
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert "Traceback" not in err and out == ""
    headers = [line for line in err.splitlines() if ": error: " in line]
    for where, key, gist in expected:
        prefix = f"{where}" + ("" if where.endswith(":") else ": ") + "error: " + (f"{key}: " if key else "")
        matching = [h for h in headers if h.startswith(prefix) or (where.endswith(":") and h.startswith(where))]
        assert matching, f"no error at {where} for {key}:\n{err}"
        assert any(gist in h for h in matching), f"gist {gist!r} not in {matching}"


def test_all_problems_reported_at_once(spec_dir: Path, capsys: pytest.CaptureFixture) -> None:
    (spec_dir / "s.yaml").write_text(MINI + "  batchh: 2\nmesh: {tp: 0}\nnumerics: {default: bf17}\nkernels: fast\n")
    assert cli.main(["check", "s.yaml", "--set", "task.steps=-1"]) == 2
    err = capsys.readouterr().err
    headers = [line.split(": error: ")[0] for line in err.splitlines() if ": error: " in line]
    assert headers == ["s.yaml:8:3", "s.yaml:9:12", "s.yaml:10:21", "s.yaml:11:10", "<--set>:1:12"]
    assert err.rstrip().endswith("5 errors")


def test_caret_points_at_the_value(spec_dir: Path, capsys: pytest.CaptureFixture) -> None:
    (spec_dir / "s.yaml").write_text(MINI + "numerics:\n  default: bf16 @acum(fp32)\n")
    assert cli.main(["check", "s.yaml"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[1] == "      default: bf16 @acum(fp32)"
    assert lines[2] == "                    ^~~~~"


def test_set_errors_show_the_override(spec_dir: Path, capsys: pytest.CaptureFixture) -> None:
    (spec_dir / "s.yaml").write_text(MINI)
    assert cli.main(["check", "s.yaml", "--set", "mesh.tp=zero"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == '<--set>:1:9: error: mesh.tp: expected an integer, got "zero"'
    assert lines[1:] == ["    mesh.tp=zero", "            ^~~~"]


def test_missing_spec_file(spec_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["check", "nope.yaml"]) == 2
    err = capsys.readouterr().err
    assert "spec file not found: nope.yaml" in err and "Traceback" not in err


def test_huge_file_refused(spec_dir: Path, capsys: pytest.CaptureFixture) -> None:
    (spec_dir / "s.yaml").write_text(MINI + "# " + "x" * (1 << 20) + "\n")
    assert cli.main(["check", "s.yaml"]) == 2
    assert "a spec may be at most 1048576 bytes" in capsys.readouterr().err


def test_extends_through_symlink_is_refused(spec_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                                            capsys: pytest.CaptureFixture) -> None:
    outside = tmp_path_factory.mktemp("outside") / "secret.yaml"
    outside.write_text("mesh: {tp: 1}\n")
    (spec_dir / "link.yaml").symlink_to(outside)
    (spec_dir / "s.yaml").write_text("extends: link.yaml\n" + MINI)
    assert cli.main(["check", "s.yaml"]) == 2
    assert "s.yaml:1:10: error: extends: `link.yaml` is outside the spec's directory" in capsys.readouterr().err


def test_enough_broken_specs() -> None:
    assert len(CASES) >= 40


def test_console_entry_point_in_a_subprocess(spec_dir: Path) -> None:
    import subprocess
    import sys

    (spec_dir / "s.yaml").write_text(MINI + "  steps: 11\nmesh: {tp: -2}\n")
    proc = subprocess.run([sys.executable, "-m", "tessera.cli", "check", "s.yaml", "--set", "kernels=fast"],
                          capture_output=True, text=True, cwd=spec_dir, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    headers = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert headers == ["s.yaml:8:3: error: duplicate key `steps`; first given at line 7, column 3",
                       "s.yaml:9:12: error: mesh.tp: must be >= 1, got -2",
                       '<--set>:1:9: error: kernels: expected one of auto, reference, got "fast"']
