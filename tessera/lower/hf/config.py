"""Model families: how a model's arguments correspond to Hugging Face `config.json`, and the checks between them.

Each family is a table of fields (arg name, config key, the dimension it sizes, HF's default when
the key is absent) plus its tensor rules; `FAMILIES` is the registry, keyed by the model file's stem.
The `args` every function here takes are the model's bound arguments (model.args laid over the .tsl
file's declared defaults, `tessera.ir.elaborate.bound_args`): the model file alone says what an
omitted argument is, so no default of a model file is repeated here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

from tessera.diagnostics import Diagnostic, Span, TesseraError, relpath
from tessera.lower.hf import mapping


@dataclasses.dataclass(frozen=True)
class Field:
    """One model argument and the config.json key (dotted for nested keys) that holds it."""

    arg: str
    hf: str
    dim: str | None = None  # the size letter the mapping table uses ("D", "H", ...)
    required: bool = True  # needed to know tensor shapes
    default: Any = None  # HF's value when config.json omits the key (a callable gets the config)


@dataclasses.dataclass(frozen=True)
class Fixed:
    """An architecture choice the model file hard-codes; config.json must agree."""

    hf: str
    value: Any  # a callable gets the config (e.g. a layer pattern that depends on the depth)
    default: Any = None  # HF's value when config.json omits the key


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: config fields, base config.json, and its rule table (by tied embeddings)."""

    name: str
    model_type: str
    architecture: str
    fields: tuple[Field, ...]
    fixed: tuple[Fixed, ...]
    base_config: dict
    rules: Callable[[bool], tuple[mapping.Rule, ...]]


_COMMON = (
    Field("vocab", "vocab_size", "V"),
    Field("d_model", "hidden_size", "D"),
    Field("layers", "num_hidden_layers", "L"),
    Field("heads", "num_attention_heads", "H"),
    Field("kv_heads", "num_key_value_heads", "KV", default=lambda c: c.get("num_attention_heads")),
    Field("d_ff", "intermediate_size", "F"),
)
_ROPE = "rope_parameters."


def _alternating(config: dict) -> list[str]:
    # GPT-OSS (models/gpt_oss.tsl and HF's default): even layers slide, odd layers attend fully
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config["num_hidden_layers"])]


GPT_OSS = Family(
    name="gpt_oss", model_type="gpt_oss", architecture="GptOssForCausalLM",
    fields=_COMMON + (
        Field("head_dim", "head_dim", "hd", default=64),
        Field("experts", "num_local_experts", "E"),
        Field("top_k", "num_experts_per_tok", required=False, default=4),
        Field("window", "sliding_window", required=False, default=128),
        Field("rope_theta", _ROPE + "rope_theta", required=False, default=150000.0),
        Field("rope_factor", _ROPE + "factor", required=False, default=32.0),
        Field("rope_original", _ROPE + "original_max_position_embeddings", required=False, default=4096),
        Field("rope_beta_fast", _ROPE + "beta_fast", required=False, default=32.0),
        Field("rope_beta_slow", _ROPE + "beta_slow", required=False, default=1.0),
        Field("swiglu_alpha", "swiglu_alpha", required=False, default=1.702),
        Field("swiglu_limit", "swiglu_limit", required=False, default=7.0),
        Field("norm_eps", "rms_norm_eps", required=False, default=1e-5),
    ),
    fixed=(
        Fixed(_ROPE + "rope_type", "yarn", default="yarn"),
        Fixed(_ROPE + "truncate", False, default=True),
        Fixed("layer_types", _alternating, default=_alternating),
        Fixed("attention_bias", True, default=True),
        Fixed("tie_word_embeddings", False, default=False),
    ),
    base_config={"attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
                 "max_position_embeddings": 131072, "router_aux_loss_coef": 0.001, "use_cache": True},
    rules=lambda tied: mapping.GPT_OSS_RULES,
)

LLAMA = Family(
    name="llama", model_type="llama", architecture="LlamaForCausalLM",
    fields=_COMMON + (
        Field("head_dim", "head_dim", "hd", required=False,
              default=lambda c: c["hidden_size"] // c["num_attention_heads"]),
        Field("tie_embeddings", "tie_word_embeddings", "tied", required=False, default=False),
        Field("rope_theta", _ROPE + "rope_theta", required=False, default=10000.0),
        Field("norm_eps", "rms_norm_eps", required=False, default=1e-6),
    ),
    fixed=(
        Fixed(_ROPE + "rope_type", "default", default="default"),
        Fixed("attention_bias", False, default=False),
        Fixed("mlp_bias", False, default=False),
        Fixed("hidden_act", "silu", default="silu"),
    ),
    base_config={"attention_dropout": 0.0, "initializer_range": 0.02, "max_position_embeddings": 131072,
                 "use_cache": True},
    rules=lambda tied: mapping.LLAMA_RULES if tied else mapping.LLAMA_UNTIED_RULES,
)

FAMILIES: dict[str, Family] = {f.name: f for f in (GPT_OSS, LLAMA)}


def family(name: str) -> Family:
    """The registered family called `name`, or a TesseraError listing the known ones."""
    if name not in FAMILIES:
        raise TesseraError(Diagnostic(f"no Hugging Face mapping for model family `{name}`",
                                      hint=f"known families: {', '.join(sorted(FAMILIES))}"))
    return FAMILIES[name]


def dims_from_args(fam: Family, args: dict) -> dict:
    """The size letters of the mapping table from the model's arguments; a missing required arg is an error."""
    missing = [f.arg for f in fam.fields if f.required and f.arg not in args]
    if missing:
        raise TesseraError([Diagnostic(f"model.args has no `{a}`, which a {fam.name} checkpoint needs",
                                       key=f"model.args.{a}") for a in missing])
    dims = {}
    for f in fam.fields:
        if f.dim is not None and args.get(f.arg) is not None:
            dims[f.dim] = args.get(f.arg)
    dims.setdefault("tied", False)
    dims.setdefault("hd", dims["D"] // dims["H"])  # Llama's head_dim defaults to d_model / heads
    return dims


def check_declared(fam: Family, args: dict, model_file: str | Path) -> None:
    """Raise when the bound arguments of `model_file` lack an argument the family's table reads."""
    missing = [f.arg for f in fam.fields if f.arg not in args]
    if missing:
        raise TesseraError([Diagnostic(f"model file {relpath(Path(model_file))} declares no argument `{a}`, which "
                                       f"the {fam.name} Hugging Face mapping reads") for a in missing])


def hf_config_from_args(family_name: str, args: dict, extra: dict | None = None) -> dict:
    """A config.json dict that `transformers` opens, from the model's bound arguments (plus `extra`, which wins)."""
    fam = family(family_name)
    config = {"architectures": [fam.architecture], "model_type": fam.model_type, **fam.base_config}
    for f in fam.fields:
        value = args.get(f.arg)
        if value is not None:
            _put(config, f.hf, value)
    for f in fam.fixed:
        _put(config, f.hf, f.value(config) if callable(f.value) else f.value)
    config.update(extra or {})
    return config


def _put(config: dict, dotted: str, value) -> None:
    head, _, leaf = dotted.rpartition(".")
    (config.setdefault(head, {}) if head else config)[leaf] = value


def _get(config: dict, dotted: str, default):
    # a (possibly nested) key; RoPE keys also as older checkpoints write them (rope_scaling, top-level rope_theta)
    head, _, leaf = dotted.rpartition(".")
    scopes = [config]
    if head == "rope_parameters":
        scopes = [config.get("rope_parameters") or {}, config.get("rope_scaling") or {}, config]
    for scope in scopes:
        if leaf in scope and scope[leaf] is not None:
            return scope[leaf]
    return default(config) if callable(default) else default


def read_config(directory: Path) -> tuple[dict, Path]:
    """config.json of a checkpoint directory as a dict, and its path."""
    path = directory / "config.json"
    if not path.is_file():
        raise TesseraError(Diagnostic(f"no config.json in {relpath(directory)}",
                                      hint="a Hugging Face checkpoint directory holds config.json and *.safetensors"))
    try:
        return json.loads(path.read_text()), path
    except json.JSONDecodeError as exc:
        raise TesseraError(Diagnostic(f"config.json is not valid JSON: {exc.msg}",
                                      span=Span(relpath(path), exc.lineno, exc.colno))) from None


def check_config(fam: Family, config: dict, args: dict, path: Path) -> None:
    """Raise one TesseraError naming every field where config.json disagrees with the model's arguments."""
    text = path.read_text()
    problems = []
    if config.get("model_type") != fam.model_type:
        problems.append(Diagnostic(
            f"config.json has model_type = {config.get('model_type')!r}, expected {fam.model_type!r}",
            span=_key_span(text, "model_type", path)))
    for f in fam.fields:
        want = args.get(f.arg)
        got = _get(config, f.hf, f.default)
        if want is not None and got != want:
            problems.append(Diagnostic(f"config.json has {f.hf} = {got!r} but model.args.{f.arg} = {want!r}",
                                       span=_key_span(text, f.hf, path), key=f"model.args.{f.arg}"))
    for f in fam.fixed:
        want = f.value(config) if callable(f.value) else f.value
        got = _get(config, f.hf, f.default)
        if got != want:
            problems.append(Diagnostic(f"config.json has {f.hf} = {got!r} but the {fam.name} model implements "
                                       f"{want!r}", span=_key_span(text, f.hf, path)))
    if problems:
        raise TesseraError(problems)


def _key_span(text: str, key: str, path: Path) -> Span | None:
    # where `"key":` is written in config.json (1-based), so the message points at it
    key = key.rpartition(".")[2]
    at = text.find(f'"{key}"')
    if at < 0:
        return None
    line = text.count("\n", 0, at) + 1
    col = at - (text.rfind("\n", 0, at) + 1) + 1
    return Span(relpath(path), line, col, col + len(key) + 2)
