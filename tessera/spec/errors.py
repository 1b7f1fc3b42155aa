"""Pydantic validation errors → diagnostics at the exact YAML position of the offending key or value."""

from __future__ import annotations

import json
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from tessera.diagnostics import Diagnostic, Span, did_you_mean
from tessera.spec.source import Node

# pydantic error type -> what we say (the got-value is appended).
_FRIENDLY = {
    "int_type": "expected an integer", "int_from_float": "expected an integer", "int_parsing": "expected an integer",
    "float_type": "expected a number", "float_parsing": "expected a number", "bool_type": "expected true or false",
    "bool_parsing": "expected true or false", "string_type": "expected a string", "list_type": "expected a list",
    "dict_type": "expected a mapping", "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping", "finite_number": "expected a finite number",
    "greater_than_equal": "must be >= {ge}", "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}", "less_than": "must be < {lt}",
    "too_short": "must have at least {min_length} item(s)", "none_required": "expected null",
}


def show(value: Any) -> str:
    """A value as the user wrote it in YAML terms."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def key_path(path: tuple) -> str:
    """("task", "prompts", 0) -> "task.prompts[0]"."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def from_validation(exc: ValidationError, root: Node, schema: type[BaseModel]) -> list[Diagnostic]:
    """One diagnostic per pydantic error, positioned in the source tree `root`."""
    return [_one(err, root, schema) for err in exc.errors(include_url=False)]


def _walk(root: Node, loc: tuple, schema: type[BaseModel] | None) -> tuple[tuple, Node, tuple]:
    """Follow `loc` through the tree, skipping union tags: (key path, deepest node reached, rest of loc)."""
    node, path = root, ()
    for i, part in enumerate(loc):
        value = node.value
        if part == "[key]":  # pydantic's marker for an error in a mapping's key rather than its value
            continue
        if isinstance(value, dict) and isinstance(part, str):
            if schema is not None and part not in _fields_of(schema, root, path):
                kind = value.get("kind")
                if kind is not None and kind.value == part:
                    continue  # the tag pydantic puts in `loc` for a member of a tagged union
                if part not in value and i + 1 < len(loc):
                    continue  # the same, for a union member whose `kind` was left to its default
            if part not in value:
                return path, node, loc[i:]
            node, path = value[part], path + (part,)
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            node, path = value[part], path + (part,)
        else:
            return path, node, loc[i:]
    return path, node, ()


def _fields_of(schema: type[BaseModel], root: Node, path: tuple) -> set[str]:
    cls = model_at(schema, root, path)
    return set(cls.model_fields) if cls else set()


def model_at(schema: type[BaseModel], root: Node, path: tuple) -> type[BaseModel] | None:
    """The pydantic model class describing the mapping at `path` (picking union members by `kind`)."""
    cls: type[BaseModel] | None = schema
    node = root
    for part in path:
        if cls is None or not isinstance(part, str) or part not in cls.model_fields:
            return None
        node = node.value[part]
        cls = _pick_model(cls.model_fields[part].annotation, node)
    return cls


def _pick_model(annotation: Any, node: Node) -> type[BaseModel] | None:
    members = []
    for arg in typing.get_args(annotation) or (annotation,):
        arg = typing.get_args(arg)[0] if typing.get_origin(arg) is typing.Annotated else arg
        members.extend(typing.get_args(arg) if typing.get_origin(arg) is typing.Union else [arg])
    models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
    if len(models) <= 1:
        return models[0] if models else None
    kind = node.value.get("kind") if isinstance(node.value, dict) else None
    wanted = kind.value if kind is not None else models[0].model_fields["kind"].default
    for m in models:
        if typing.get_args(m.model_fields["kind"].annotation) == (wanted,):
            return m
    return None


def _one(err: dict[str, Any], root: Node, schema: type[BaseModel]) -> Diagnostic:
    kind, ctx = err["type"], err.get("ctx") or {}
    path, node, rest = _walk(root, tuple(err["loc"]), schema)
    if kind == "missing":
        name = rest[0] if rest else path[-1]
        return Diagnostic(f"missing required key `{name}`", node.key_span or node.span, key_path(path + (name,)))
    path += tuple(p for p in rest if p != "[key]")  # below what the tree holds (not expected in practice)
    if kind == "extra_forbidden":
        choices = sorted(_fields_of(schema, root, path[:-1]) - {"extends"})
        return Diagnostic(f"unknown key `{path[-1]}`", node.key_span or node.span, key_path(path),
                          hint=did_you_mean(str(path[-1]), choices) or _choices(choices))
    if kind.startswith("union_tag"):
        return _union_tag(kind, ctx, path, node)
    for part in ctx.get("at") or ():  # custom errors point below the field (a list item, a rule entry)
        sub_path, sub_node, sub_rest = _walk(node, (part,), None)
        if not sub_rest:
            node, path = sub_node, path + sub_path
    on_key = "[key]" in err["loc"] or isinstance(node.value, dict)  # a bad key, or a check of a whole mapping
    span = node.key_span if on_key and node.key_span else _value_span(node, ctx)
    return Diagnostic(_message(kind, err, ctx, node), span, key_path(path),
                      hint=ctx.get("hint") or _literal_hint(kind, ctx, node) or None)


def _message(kind: str, err: dict[str, Any], ctx: dict[str, Any], node: Node) -> str:
    if "message" in ctx:
        return ctx["message"]
    if kind == "literal_error":
        return f"expected one of {_choice_text(ctx)}, got {show(node.value)}"
    if kind in _FRIENDLY:
        got = "" if kind == "too_short" else f", got {show(node.value)}"
        return _FRIENDLY[kind].format(**ctx) + got
    msg = err["msg"]
    return re.sub(r"^(Value|Assertion) error, ", "", msg)


def _union_tag(kind: str, ctx: dict[str, Any], path: tuple, node: Node) -> Diagnostic:
    tags = re.findall(r"'([^']*)'", ctx.get("expected_tags", ""))
    if not isinstance(node.value, dict):
        return Diagnostic(f"expected a mapping, got {show(node.value)}", node.span, key_path(path))
    if kind == "union_tag_not_found" or "kind" not in node.value:
        return Diagnostic("missing required key `kind`", node.key_span or node.span,
                          key_path(path + ("kind",)), hint=f"one of {', '.join(tags)}" if tags else None)
    tag = node.value["kind"]
    return Diagnostic(f"unknown kind {show(tag.value)}; expected one of {', '.join(tags)}", _value_span(tag, {}),
                      key_path(path + ("kind",)), hint=did_you_mean(str(tag.value), tags))


def _choice_text(ctx: dict[str, Any]) -> str:
    return ", ".join(re.findall(r"'([^']*)'", str(ctx.get("expected", "")))) or str(ctx.get("expected"))


def _literal_hint(kind: str, ctx: dict[str, Any], node: Node) -> str | None:
    if kind != "literal_error" or not isinstance(node.value, str):
        return None
    return did_you_mean(node.value, re.findall(r"'([^']*)'", str(ctx.get("expected", ""))))


def _choices(choices: list[str]) -> str | None:
    return f"valid keys here: {', '.join(choices)}" if choices else None


def _value_span(node: Node, ctx: dict[str, Any]) -> Span:
    span = node.span
    if "offset" not in ctx or node.span.end_col is None:  # a position inside a one-line scalar
        return span
    col = span.col + int(node.quoted) + int(ctx["offset"])
    return Span(span.file, span.line, col, col + int(ctx.get("length") or 1), text=span.text)
