"""The YAML loader: YAML 1.2 scalars, positions of keys and values, refusal of hostile input."""

from __future__ import annotations

import math

import pytest

from tessera.diagnostics import TesseraError
from tessera.spec.dump import dump_yaml
from tessera.spec.source import load_text


def plain(text: str):
    node = load_text(text, "f.yaml")
    return node.plain() if node is not None else None


@pytest.mark.parametrize("text, value", [
    ("1e-3", 0.001), ("1.0e-05", 1e-5), ("-2E4", -20000.0), (".5", 0.5), ("3", 3), ("-7", -7), ("007", 7),
    ("0x1f", 31), ("0o17", 15), (".inf", math.inf), ("-.inf", -math.inf), ("true", True), ("False", False),
    ("null", None), ("~", None), ("", None),
    # YAML 1.1 traps: all of these are strings
    ("yes", "yes"), ("no", "no"), ("on", "on"), ("off", "off"), ("y", "y"), ("1:30", "1:30"), ("1_000", "1_000"),
    ("0b101", "0b101"), ("2024-01-02", "2024-01-02"), ("'1e-3'", "1e-3"), ("'true'", "true"),
])
def test_yaml_12_scalars(text: str, value) -> None:
    assert plain(f"a: {text}\n") == {"a": value}


def test_nan() -> None:
    assert math.isnan(plain("a: .nan\n")["a"])


def test_positions_of_keys_and_values() -> None:
    root = load_text("model:\n  args: {heads: 64}\nlist:\n  - [1, 2]\n", "f.yaml")
    heads = root.value["model"].value["args"].value["heads"]
    assert (heads.key_span.line, heads.key_span.col) == (2, 10)
    assert (heads.span.line, heads.span.col, heads.span.end_col) == (2, 17, 19)
    second = root.value["list"].value[0].value[1]
    assert (second.span.line, second.span.col) == (4, 9)
    quoted = load_text('a: "bf16"\n', "f.yaml").value["a"]
    assert quoted.quoted and quoted.span.col == 4


def test_origin_shifts_positions_into_an_override() -> None:
    node = load_text("[1, x]", "<--set>", line_text="k=[1, x]", origin=(3, 2))
    assert (node.value[1].span.line, node.value[1].span.col) == (3, 7)
    assert node.value[1].span.text == "k=[1, x]"


def test_all_duplicate_keys_at_once() -> None:
    with pytest.raises(TesseraError) as info:
        load_text("a: 1\nb: {c: 1, c: 2}\na: 3\n", "f.yaml")
    assert [str(d.span) for d in info.value.diagnostics] == ["f.yaml:2:11", "f.yaml:3:1"]


@pytest.mark.parametrize("text, where, gist", [
    ("a: !!binary aGVsbG8=\n", "f.yaml:1:4", "unsupported YAML tag"),
    ("a: !!int abc\n", "f.yaml:1:4", "`abc` is not a valid int"),
    ("a: !!bool yes\n", "f.yaml:1:4", "`yes` is not a valid bool"),
    ("<<: {a: 1}\n", None, None),  # no merge keys: `<<` is an ordinary (later unknown) key
    ("a: &x [*x]\n", "f.yaml:1:4", "nesting deeper than 100"),
    ("? [a]\n: 1\n", "f.yaml:1:3", "keys must be plain names"),
    ("a: 1\n\x07\n", "f.yaml:2:1", "invalid character"),
])
def test_refused_input(text: str, where: str | None, gist: str | None) -> None:
    if where is None:
        assert plain(text) == {"<<": {"a": 1}}
        return
    with pytest.raises(TesseraError) as info:
        load_text(text, "f.yaml")
    first = info.value.diagnostics[0]
    assert str(first.span) == where and gist in first.message


def test_dump_quotes_what_would_read_back_differently() -> None:
    data = {"a": "1e-3", "b": "yes", "c": "1:30", "d": "true", "e": "null", "f": 1e-5, "g": [1, 2], "h": "plain"}
    text = dump_yaml(data)
    assert plain(text) == data
    assert "g: [1, 2]" in text and "h: plain" in text
