"""Safe YAML loading that keeps the position of every key and value.

PyYAML composes the document into nodes (which carry 0-based marks); we build our own tree of
`Node`s from them instead of using PyYAML's constructors, so that:
  * scalars follow YAML 1.2's core schema: `1e-3` is a float, only true/false are booleans,
    `1:30` is a string, `on`/`yes`/`no` are strings;
  * duplicate keys are an error (PyYAML silently keeps the last one);
  * hostile input is refused: files over 1 MiB, nesting deeper than 100, alias bombs;
  * only plain data tags are accepted (no `!!python/...`, no merge keys).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from tessera.diagnostics import Diagnostic, Span, TesseraError, relpath

MAX_BYTES = 1 << 20  # 1 MiB: a spec is a page of text, never a data file
MAX_DEPTH = 100  # nesting of mappings/sequences
MAX_NODES = 100_000  # nodes after expanding aliases (a billion-laughs bomb expands exponentially)

_TAG = "tag:yaml.org,2002:"
_COLLECTIONS = (_TAG + "map", _TAG + "seq")


@dataclasses.dataclass
class Node:
    """A YAML value with its position: `value` is a dict[str, Node], a list[Node] or a scalar."""

    value: Any
    span: Span  # where the value starts
    key_span: Span | None = None  # where the key that names this value was written
    quoted: bool = False  # the scalar was written in quotes: its text starts one column after `span`

    def plain(self) -> Any:
        """The value as plain Python data (dicts, lists, scalars), positions dropped."""
        if isinstance(self.value, dict):
            return {k: v.plain() for k, v in self.value.items()}
        if isinstance(self.value, list):
            return [v.plain() for v in self.value]
        return self.value

    def walk(self, path: tuple = ()) -> Iterator[tuple[tuple, "Node"]]:
        """Every (key path, node) pair below and including this one; list items use int keys."""
        yield path, self
        if isinstance(self.value, dict):
            for k, v in self.value.items():
                yield from v.walk(path + (k,))
        elif isinstance(self.value, list):
            for i, v in enumerate(self.value):
                yield from v.walk(path + (i,))


class _Loader(yaml.SafeLoader):
    """PyYAML's safe composer with YAML 1.2 core-schema scalars and a nesting limit."""

    yaml_implicit_resolvers: dict = {}

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(f"nesting deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _resolver(tag: str, pattern: str, first: str | list[str]) -> None:
    _Loader.add_implicit_resolver(_TAG + tag, re.compile(pattern, re.X), list(first))


# YAML 1.2 core schema, in the order PyYAML tries them (int before float).
_resolver("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF")
_resolver("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""])
_resolver("int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789")
_resolver("float", r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
                          |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", "-+0123456789.")


class _Refused(Exception):
    """Raised inside the composer for hostile input; carries the PyYAML mark."""

    def __init__(self, message: str, mark: Any):
        super().__init__(message)
        self.message, self.mark = message, mark


def load_file(path: Path, display: str | None = None, soft: list[Diagnostic] | None = None) -> Node:
    """Load one YAML spec file into a `Node` tree; problems are TesseraErrors with a position.

    With `soft`, problems that leave a usable tree (duplicate keys: the first value is kept; bad
    tags) are appended there instead of raised, so they are reported with everything else.
    """
    name = display or relpath(path)
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise TesseraError(Diagnostic(f"file is {size} bytes; a spec may be at most {MAX_BYTES} bytes",
                                          Span(name, 1, 1)))
        data = path.read_bytes()
    except OSError as exc:
        raise TesseraError(Diagnostic(f"cannot read {name}: {exc.strerror or exc}")) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise TesseraError(Diagnostic("file is not valid UTF-8", Span(name, line, col))) from None
    root = load_text(text, name, soft=soft)
    if root is None:
        raise TesseraError(Diagnostic("the spec is empty; expected a mapping such as `name: ...`",
                                      Span(name, 1, 1), source_line=""))
    if not isinstance(root.value, dict):
        raise TesseraError(Diagnostic(f"the spec must be a mapping of keys to values, not a {_kind(root)}",
                                      root.span))
    return root


def load_text(text: str, name: str, line_text: str | None = None, origin: tuple[int, int] = (1, 0),
              soft: list[Diagnostic] | None = None) -> Node | None:
    """Load YAML text (a file's content or a `--set` value); None for an empty document.

    `origin` = (line of the text's first line, columns before its first character), for text cut
    out of a longer line such as the value of `--set key=value`; `line_text` is that whole line.
    `soft` collects the problems that leave a usable tree, as in `load_file`.
    """
    pos = _Positions(name, line_text, origin)
    if len(text) > MAX_BYTES:
        raise TesseraError(Diagnostic(f"text is longer than {MAX_BYTES} characters", Span(name, 1, 1)))
    loader = None
    try:
        loader = _Loader(text)
        node = loader.get_single_node()
    except _Refused as exc:
        raise TesseraError(Diagnostic(exc.message, pos.mark(exc.mark))) from None
    except yaml.MarkedYAMLError as exc:
        raise TesseraError(_syntax_diagnostic(pos, exc)) from None
    except yaml.YAMLError as exc:  # reader errors (control characters) carry a character offset
        at = getattr(exc, "position", 0) or 0
        line, col = text.count("\n", 0, at), at - (text.rfind("\n", 0, at) + 1)
        reason = getattr(exc, "reason", None) or "unreadable character"
        raise TesseraError(Diagnostic(f"invalid character: {reason}", pos.at(line, col))) from None
    finally:
        if loader is not None:
            loader.dispose()
    if node is None:
        return None
    builder = _Builder(pos)
    root = builder.build(node, 0)
    if builder.problems and soft is None:
        raise TesseraError(builder.problems)
    if soft is not None:
        soft.extend(builder.problems)
    return root


class _Positions:
    """Turns PyYAML's 0-based marks into 1-based spans of one source (a file, or a `--set` value)."""

    def __init__(self, name: str, line_text: str | None, origin: tuple[int, int]):
        self.name, self.line_text, self.origin = name, line_text, origin

    def at(self, line: int, col: int, end_col: int | None = None) -> Span:
        """The span at 0-based (line, col) of the text; `end_col` is 0-based exclusive on the same line."""
        shift = self.origin[1] if line == 0 else 0
        end = end_col + 1 + shift if end_col is not None else col + 2 + shift
        return Span(self.name, line + self.origin[0], col + 1 + shift, end, text=self.line_text)

    def mark(self, mark: Any) -> Span:
        return self.at(mark.line, mark.column)

    def node(self, node: yaml.Node) -> Span:
        start, end = node.start_mark, node.end_mark
        one_line = end.line == start.line and end.column > start.column
        span = self.at(start.line, start.column, end.column if one_line else None)
        return span if one_line else Span(span.file, span.line, span.col, None, text=span.text)


_UNCLOSED = {"flow sequence": "`]`", "flow mapping": "`}`", "quoted scalar": "its closing quote"}


def _syntax_diagnostic(pos: _Positions, exc: yaml.MarkedYAMLError) -> Diagnostic | list[Diagnostic]:
    construct = next((c for c in _UNCLOSED if exc.context and c in exc.context), None)
    if construct and exc.context_mark is not None and exc.problem_mark is not None:  # at what is left open
        return [Diagnostic(f"YAML syntax error: this {construct} is not closed", pos.mark(exc.context_mark),
                           hint=f"close it with {_UNCLOSED[construct]}"),
                Diagnostic(f"the YAML parser gave up here: {exc.problem}", pos.mark(exc.problem_mark),
                           severity="note")]
    mark = exc.problem_mark or exc.context_mark
    span = pos.mark(mark) if mark else pos.at(0, 0)
    problem = exc.problem or exc.context or "invalid YAML"
    if "'\\t'" in problem:
        return Diagnostic("tab character; YAML needs spaces for indentation and between tokens",
                          span, hint="replace the tab with spaces")
    if problem.startswith("but ") and exc.context:  # "expected a single document ..., but found another"
        return Diagnostic(f"YAML syntax error: {exc.context}, {problem}", span)
    message = f"YAML syntax error: {problem}"
    if exc.context and exc.problem and exc.context_mark is not None and exc.context_mark != mark:
        where = pos.mark(exc.context_mark)
        message += f" ({exc.context} at line {where.line}, column {where.col})"
    return Diagnostic(message, span)


def _kind(node: Node) -> str:
    if isinstance(node.value, dict):
        return "mapping"
    if isinstance(node.value, list):
        return "list"
    return "string" if isinstance(node.value, str) else "scalar value"


class _Builder:
    """Turns composed PyYAML nodes into `Node`s, collecting every duplicate-key and tag problem."""

    def __init__(self, pos: _Positions):
        self.pos = pos
        self.problems: list[Diagnostic] = []
        self.count = 0

    def span(self, node: yaml.Node) -> Span:
        return self.pos.node(node)

    def build(self, node: yaml.Node, depth: int) -> Node:
        self.count += 1
        if self.count > MAX_NODES:
            raise TesseraError(Diagnostic(f"the document expands to more than {MAX_NODES} values "
                                          "(aliases referring to aliases?)", self.span(node)))
        if depth > MAX_DEPTH:
            raise TesseraError(Diagnostic(f"nesting deeper than {MAX_DEPTH} levels (through aliases?)",
                                          self.span(node)))
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and node.tag not in _COLLECTIONS:
            self.problems.append(Diagnostic(f"unsupported YAML tag `{node.tag}`; only plain values are allowed",
                                            self.span(node)))
        if isinstance(node, yaml.MappingNode):
            return self.mapping(node, depth)
        if isinstance(node, yaml.SequenceNode):
            return Node([self.build(item, depth + 1) for item in node.value], self.span(node))
        return Node(self.scalar(node), self.span(node), quoted=node.style in ("'", '"'))

    def mapping(self, node: yaml.MappingNode, depth: int) -> Node:
        items: dict[str, Node] = {}
        for key_node, value_node in node.value:
            key_span = self.span(key_node)
            if not isinstance(key_node, yaml.ScalarNode):
                self.problems.append(Diagnostic("keys must be plain names, not a mapping or list", key_span))
                continue
            key = key_node.value
            if key in items:
                first = items[key].key_span
                self.problems.append(Diagnostic(f"duplicate key `{key}`", key_span,
                                                hint=f"first given at line {first.line}, column {first.col}"
                                                if first else None))
                continue
            child = self.build(value_node, depth + 1)
            child.key_span = key_span
            items[key] = child
        return Node(items, self.span(node))

    def scalar(self, node: yaml.ScalarNode) -> Any:
        tag, text = node.tag, node.value
        convert = _SCALARS.get(tag[len(_TAG):] if tag.startswith(_TAG) else "")
        if convert is None:
            self.problems.append(Diagnostic(f"unsupported YAML tag `{tag}`; only plain values are allowed",
                                            self.span(node)))
            return text
        try:
            return convert(text)
        except ValueError:  # an explicit tag on text that is not of its type: `!!int abc`
            self.problems.append(Diagnostic(f"`{text}` is not a valid {tag[len(_TAG):]}", self.span(node)))
            return text


def _int(text: str) -> int:
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text.lstrip("+"))
    return sign * (int(body, 0) if body[:2] in ("0x", "0o") else int(body, 10))


def _float(text: str) -> float:
    low = text.lower()
    if low.endswith(".inf"):
        return -math.inf if low.startswith("-") else math.inf
    if low.endswith(".nan"):
        return math.nan
    return float(text)


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(text)
    return text.lower() == "true"


_SCALARS: dict[str, Callable[[str], Any]] = {
    "str": str,
    "int": _int,
    "float": _float,
    "bool": _bool,
    "null": lambda t: None,
}
