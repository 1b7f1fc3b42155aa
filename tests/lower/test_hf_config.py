"""The Hugging Face config check and export read a model's arguments as its .tsl file binds them.

An argument a spec leaves out takes the model file's declared default, so editing that default in the
.tsl file changes what config.json must say (on load) and what it says (on export).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tessera
from tessera.diagnostics import TesseraError
from tessera.lower.weights import hf_config_from_args, load_hf_weights, model_args, save_weights

from .conftest import HF_DATA, hf_fixture

MODELS = Path(__file__).resolve().parents[2] / "models"
GPT_ARGS = hf_fixture("gpt_oss")["meta"]["args"]  # sets window, leaves rope_theta and norm_eps to the file
STOCK, EDITED = "rope_theta: float = 150000.0", "rope_theta: float = 250000.0"


def _model_copy(tmp_path: Path, old: str, new: str) -> Path:
    # models/gpt_oss.tsl with one piece of text replaced
    text = (MODELS / "gpt_oss.tsl").read_text()
    assert text.count(old) >= 1, old
    path = tmp_path / "models" / "gpt_oss.tsl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.replace(old, new))
    return path


def _program(tmp_path: Path, args: dict):
    # a spec over the edited model file that sets only `args` (nothing about RoPE unless args do)
    lines = ["name: edited_default", "model:", "  file: models/gpt_oss.tsl", "  args:"]
    lines += [f"    {k}: {v}" for k, v in args.items()]
    lines += ["numerics: {default: fp32, params: fp32}", "task: {kind: forward, tokens: [[1, 2]]}"]
    spec = tmp_path / "edited.yaml"
    spec.write_text("\n".join(lines) + "\n")
    return tessera.compile(tessera.load(spec))


@pytest.fixture(scope="module")
def hf_params():
    """The dense GPT-OSS fixture's weights, read with the stock model file."""
    return load_hf_weights(HF_DATA / "gpt_oss", family="gpt_oss", args=GPT_ARGS, model=MODELS / "gpt_oss.tsl")


def test_export_writes_the_model_files_default(tmp_path, hf_params):
    _model_copy(tmp_path, STOCK, EDITED)
    prog = _program(tmp_path, GPT_ARGS)
    out = save_weights(hf_params, tmp_path / "export", options=prog.options, graph=prog.graph)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 250000.0  # the edited file's value, not 150000.0
    assert config["sliding_window"] == 4 and config["rms_norm_eps"] == 1e-5  # set by the spec / the file
    again = prog.load_weights(out)  # the export agrees with the program that wrote it
    assert set(again) == set(hf_params)


def test_a_checkpoint_with_the_old_default_is_refused(tmp_path):
    _model_copy(tmp_path, STOCK, EDITED)
    prog = _program(tmp_path, GPT_ARGS)
    with pytest.raises(TesseraError) as exc:
        prog.load_weights(HF_DATA / "gpt_oss")  # its config.json says rope_theta = 150000.0
    (diag,) = exc.value.diagnostics
    assert diag.message == ("config.json has rope_parameters.rope_theta = 150000.0 but model.args.rope_theta = "
                            "250000.0")
    assert diag.key == "model.args.rope_theta"
    line = (HF_DATA / "gpt_oss" / "config.json").read_text().splitlines()[diag.span.line - 1]
    assert line[diag.span.col - 1:].startswith('"rope_theta"')
    # the spec setting the checkpoint's value wins over the file's default
    _program(tmp_path, dict(GPT_ARGS, rope_theta=150000.0)).load_weights(HF_DATA / "gpt_oss")


def test_every_default_of_the_file_is_read(tmp_path):
    path = _model_copy(tmp_path, "norm_eps: float = 1e-5", "norm_eps: float = 1e-6")
    config = hf_config_from_args("gpt_oss", model_args("gpt_oss", GPT_ARGS, path))
    assert config["rms_norm_eps"] == 1e-6 and config["rope_parameters"]["rope_theta"] == 150000.0
    llama = hf_config_from_args("llama", model_args("llama", hf_fixture("llama")["meta"]["args"],
                                                    MODELS / "llama.tsl"))
    assert llama["rope_parameters"]["rope_theta"] == 500000.0  # llama.tsl's default, not HF's 10000.0
    with pytest.raises(TesseraError) as exc:
        load_hf_weights(HF_DATA / "gpt_oss", family="gpt_oss", args=GPT_ARGS, model=path)
    assert [d.key for d in exc.value.diagnostics] == ["model.args.norm_eps"]


def test_without_the_model_file_only_the_given_args_are_written():
    config = hf_config_from_args("llama", hf_fixture("llama")["meta"]["args"])
    assert "rope_theta" not in config.get("rope_parameters", {}) and "rms_norm_eps" not in config


def test_a_model_file_without_an_argument_the_table_reads_is_refused(tmp_path):
    path = _model_copy(tmp_path, "swiglu_limit", "clamp")
    with pytest.raises(TesseraError) as exc:
        model_args("gpt_oss", GPT_ARGS, path)
    assert [d.message for d in exc.value.diagnostics] == [
        f"model file {path} declares no argument `swiglu_limit`, which the gpt_oss Hugging Face mapping reads"]


def test_an_undeclared_argument_is_the_model_files_error(tmp_path):
    with pytest.raises(TesseraError, match="model `gpt_oss` has no argument `rope_thetta`"):
        model_args("gpt_oss", dict(GPT_ARGS, rope_thetta=1.0), MODELS / "gpt_oss.tsl")
