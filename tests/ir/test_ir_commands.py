"""`tessera ir` and the model-level part of `tessera check`, through the command line entry point."""

import types

import pytest

from tessera.cli import main
from tessera.diagnostics import Span, relpath
from tessera.ir import build_graph
from tessera.ir.check import check_mesh_divides
from tessera.ir.passes import PIPELINE
from tests.ir.conftest import LLAMA, MODELS, ROOT

SPECS = sorted((ROOT / "specs").glob("*.yaml"))


def test_ir_after_fuse_prints_the_fused_graph(capsys):
    assert main(["ir", str(ROOT / "specs" / "llama_tiny.yaml"), "--after", "fuse"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("graph llama {\n") and out.endswith("}\n")
    assert "= attention(" in out and "= mlp(" in out and "= softmax(" not in out


def test_ir_after_decompose_with_an_override(capsys):
    assert main(["ir", str(ROOT / "specs" / "llama_tiny.yaml"), "--after", "decompose",
                 "--set", "model.args.layers=3"]) == 0
    out = capsys.readouterr().out
    assert "= softmax(" in out and "{n = 3, axis = layers, grad = \"all\"}" in out


@pytest.mark.parametrize("spec", SPECS, ids=[s.stem for s in SPECS])
def test_every_shipped_spec_round_trips_after_every_pass(spec, capsys):
    assert main(["ir", str(spec), "--roundtrip"]) == 0
    assert capsys.readouterr().out.split() == [w for name in PIPELINE for w in (f"{name}:", "ok")]
    assert PIPELINE[:5] == ["verify", "canonicalize", "decompose", "fuse", "numerics"]


def test_unknown_pass_exits_2(capsys):
    assert main(["ir", str(ROOT / "specs" / "llama_tiny.yaml"), "--after", "fusion"]) == 2
    assert "error: unknown pass `fusion`; did you mean `fuse`?" in capsys.readouterr().err


def test_check_reports_a_numeric_rule_that_matches_nothing(tmp_path, capsys):
    base = (ROOT / "specs" / "llama_tiny.yaml").read_text().replace("../models/llama.tsl", str(MODELS / "llama.tsl"))
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "bad.yaml").write_text('extends: base.yaml\nname: bad\nnumerics:\n  rules:\n    "*/mlp/gat": bf16\n')
    assert main(["check", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("bad.yaml:5:18: error: numerics.rules: numeric rule `*/mlp/gat` matches no parameter "
                           "of model `llama`; parameter paths look like embed/table, layers/attn_norm/scale, "
                           "layers/attention/q")


def test_check_accepts_the_shipped_specs(capsys):
    for spec in SPECS:
        assert main(["check", str(spec)]) == 0, spec


def test_mesh_axis_must_divide_the_dims_it_shards():
    graph = build_graph(MODELS / "llama.tsl", {**LLAMA, "d_ff": 96})
    spans = {"parallel.rules.mlp": Span("s.yaml", 7, 12)}
    spans["mesh.tp"] = Span("s.yaml", 3, 9)
    exp = types.SimpleNamespace(mesh=types.SimpleNamespace(axes={"tp": 5, "fsdp": 1}),
                                parallel=types.SimpleNamespace(rules={"mlp": "tp", "embed": "fsdp"},
                                                               sequence_parallel=False),
                                span=spans.get)
    problems = check_mesh_divides(exp, graph)
    assert [p.render().splitlines()[0] for p in problems] == [
        "s.yaml:3:9: error: mesh.tp: tp=5 does not divide `mlp` = 96 (param `layers/mlp/gate`); "
        "use a mesh whose tp divides 96: 1, 2, 3, 4, 6, 8 ...",
        "s.yaml:7:12: note: `mlp` is split over tp by this rule",
        f"{relpath(MODELS / 'llama.tsl')}:11:16: note: `layers/mlp/gate` is declared here with `mlp` = 96"]


@pytest.mark.parametrize("numeric", ["fp8_e5m2", "int8", "mxfp4 @accum(fp32)"])
def test_check_refuses_a_compute_type_the_lowering_cannot_compute_in(tmp_path, capsys, numeric):
    """A storage format as numerics.default once passed `check` and failed in the lowering with a traceback."""
    base = (ROOT / "specs" / "llama_tiny.yaml").read_text().replace("../models/llama.tsl", str(MODELS / "llama.tsl"))
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "bad.yaml").write_text(f"extends: base.yaml\nname: bad\nnumerics:\n  default: {numeric}\n")
    assert main(["check", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    name = numeric.split()[0]
    if name == "fp8_e5m2":  # fp8 compute runs as e4m3 forward, e5m2 gradients
        assert "bad.yaml:4:12: error: numerics.default: fp8 compute runs the products' inputs in e4m3 and their " \
            "gradients in e5m2" in err and "write `fp8_e4m3 @scale(per_tensor)`" in err
    else:
        assert f"bad.yaml:4:12: error: numerics.default: `{name}` is a storage format" in err
        assert "compute in fp32, bf16, fp16" in err and "numerics.rules" in err
    for ok in ("fp16", "bf16 @accum(fp32)", "fp8_e4m3 @scale(per_tensor)"):
        (tmp_path / "ok.yaml").write_text(f"extends: base.yaml\nname: ok\nnumerics:\n  default: {ok}\n")
        assert main(["check", str(tmp_path / "ok.yaml")]) == 0


def test_a_misspelled_model_argument_is_reported_at_its_key(tmp_path, capsys):
    base = (ROOT / "specs" / "llama_tiny.yaml").read_text().replace("../models/llama.tsl", str(MODELS / "llama.tsl"))
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "bad.yaml").write_text("extends: base.yaml\nname: bad\nmodel:\n  args:\n    layerz: 16\n")
    assert main(["check", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml:5:5: error: model `llama` has no argument `layerz`; did you mean `layers`?" in err
    assert main(["check", str(tmp_path / "base.yaml"), "--set", "model.args.layerz=3"]) == 2
    assert "<--set>:1:12: error: model `llama` has no argument `layerz`" in capsys.readouterr().err
