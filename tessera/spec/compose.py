"""Building one source tree from a spec: `extends:` chains (deep merge, child wins) and `--set` overrides."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from tessera.diagnostics import Diagnostic, Span, TesseraError, relpath
from tessera.spec.source import Node, load_file, load_text

MAX_EXTENDS = 16  # length of an extends chain
SET_FILE = "<--set>"  # the pseudo-file of command-line overrides; its line N is the N-th override
_SEGMENT = re.compile(r"[^.\s=]+")


def load_tree(path: Path, root_dir: Path, chain: tuple[Path, ...] = (),
              soft: list[Diagnostic] | None = None) -> Node:
    """Load `path` and, recursively, what it extends; the merged tree (without `extends`).

    Problems that do not stop loading (duplicate keys) go to `soft` when given (see `load_file`).
    """
    node = load_file(path, soft=soft)
    ext = node.value.pop("extends", None)
    if ext is None or ext.value is None:
        return node
    base = _extends_target(ext, path, root_dir, chain + (path.resolve(),))
    return merge(load_tree(base, root_dir, chain + (path.resolve(),), soft), node)


def _extends_target(ext: Node, path: Path, root_dir: Path, chain: tuple[Path, ...]) -> Path:
    def bad(message: str, hint: str | None = None) -> TesseraError:
        return TesseraError(Diagnostic(message, ext.span, "extends", hint))

    if not isinstance(ext.value, str) or not ext.value:
        raise bad("expected a relative path to a base spec, e.g. `extends: base/gpt_oss.yaml`")
    if Path(ext.value).is_absolute():
        raise bad("extends takes a path relative to this file, not an absolute path")
    target = (path.parent / ext.value).resolve()
    if not target.is_relative_to(root_dir):
        raise bad(f"`{ext.value}` is outside the spec's directory {relpath(root_dir)}",
                  "a spec may only extend files in its own directory tree")
    if target in chain:
        cycle = " -> ".join(relpath(p) for p in chain[chain.index(target):] + (target,))
        raise bad(f"extends cycle: {cycle}")
    if not target.is_file():
        raise bad(f"no such file: {relpath(target)}")
    if len(chain) >= MAX_EXTENDS:
        raise bad(f"extends chain longer than {MAX_EXTENDS} files")
    return target


def merge(base: Node, child: Node) -> Node:
    """Deep merge of two mappings: the child's values win, mappings merge key by key, lists are replaced."""
    if not (isinstance(base.value, dict) and isinstance(child.value, dict)):
        return child
    items = dict(base.value)
    for key, value in child.value.items():
        items[key] = merge(items[key], value) if key in items else value
        items[key].key_span = value.key_span
    return Node(items, child.span, child.key_span)


def parse_overrides(overrides: Iterable[str] | Mapping[str, Any] | str | None) -> list[tuple[list[tuple[str, Span]], Node]]:
    """`--set KEY=VALUE` strings (value parsed as YAML) or a {dotted key: value} mapping → (key segments, value)."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        overrides = [overrides]
    if isinstance(overrides, Mapping):
        items = [(_from_mapping, (key, value)) for key, value in overrides.items()]
    else:
        items = [(_from_text, (text,)) for text in overrides]
    parsed, problems = [], []
    for line, (parse, args) in enumerate(items, start=1):
        try:
            parsed.append(parse(line, *args))
        except TesseraError as exc:  # report every bad override, not just the first
            problems.extend(exc.diagnostics)
    if problems:
        raise TesseraError(problems)
    return parsed


def _from_text(line: int, text: Any) -> tuple[list[tuple[str, Span]], Node]:
    text = str(text)
    eq = text.find("=")
    if eq <= 0:
        raise TesseraError(Diagnostic("expected KEY=VALUE, e.g. --set mesh.tp=4", Span(SET_FILE, line, 1, text=text)))
    segments = _segments(text[:eq], line, text)
    value = load_text(text[eq + 1:], SET_FILE, line_text=text, origin=(line, eq + 1))
    if value is None:  # `key=` sets null
        value = Node(None, Span(SET_FILE, line, eq + 2, text=text))
    return segments, value


def _segments(key: str, line: int, text: str) -> list[tuple[str, Span]]:
    segments, col = [], 1
    for part in key.split("."):
        if not _SEGMENT.fullmatch(part):
            what = "an empty key segment" if not part else f"`{part}` is not a key"
            raise TesseraError(Diagnostic(f"bad key in override: {what}", Span(SET_FILE, line, col, text=text),
                                          key, "keys are dotted names, e.g. task.optimizer.lr"))
        segments.append((part, Span(SET_FILE, line, col, col + len(part), text=text)))
        col += len(part) + 1
    if segments[0][0] == "extends":
        raise TesseraError(Diagnostic("`extends` cannot be overridden", segments[0][1], "extends"))
    return segments


def _from_mapping(line: int, key: Any, value: Any) -> tuple[list[tuple[str, Span]], Node]:
    text = f"{key}={value}"
    segments = _segments(str(key), line, text)
    return segments, _python_node(value, Span(SET_FILE, line, len(str(key)) + 2, text=text))


def _python_node(value: Any, span: Span) -> Node:
    if isinstance(value, Mapping):
        return Node({str(k): _keyed(_python_node(v, span), span) for k, v in value.items()}, span)
    if isinstance(value, (list, tuple)):
        return Node([_python_node(v, span) for v in value], span)
    if value is None or isinstance(value, (bool, int, float, str)):
        return Node(value, span)
    return Node(str(value), span)  # a Path, a NumericType: their text is what a YAML file would hold


def _keyed(node: Node, span: Span) -> Node:
    node.key_span = span
    return node


def apply_overrides(root: Node, overrides: list[tuple[list[tuple[str, Span]], Node]]) -> None:
    """Set each override's value at its key path in `root`, creating mappings on the way (in place)."""
    for segments, value in overrides:
        node = root
        for i, (name, span) in enumerate(segments[:-1]):
            child = node.value.get(name)
            if child is None or child.value is None:
                child = node.value[name] = Node({}, span, span)
            if not isinstance(child.value, dict):
                dotted = ".".join(s for s, _ in segments[: i + 1])
                raise TesseraError(Diagnostic(f"`{dotted}` is not a mapping, so it has no key "
                                              f"`{segments[i + 1][0]}`", segments[i + 1][1], dotted))
            node = child
        name, span = segments[-1]
        value.key_span = span
        old = node.value.get(name)
        if name == "kind" and old is not None and old.value != value.value:
            _switch_kind(node, tuple(s for s, _ in segments[:-1]), value.value)
        node.value[name] = merge(old, value) if old is not None else value
        node.value[name].key_span = span


def _kind_fields(path: tuple[str, ...], kind: Any) -> set[str] | None:
    """The keys a `kind`-keyed section at `path` accepts for `kind` (None: not such a section, or unknown kind)."""
    from tessera.spec import tasks

    unions = {("task",): (tasks.TrainTask, tasks.GenerateTask, tasks.ForwardTask, tasks.BenchTask),
              ("task", "data"): (tasks.SyntheticData, tasks.TokenData)}
    for model in unions.get(path, ()):
        if model.model_fields["kind"].annotation.__args__[0] == kind:
            return set(model.model_fields)
    return None


def _switch_kind(section: Node, path: tuple[str, ...], kind: Any) -> None:
    """`--set task.kind=generate` on a train spec: the old kind's own fields go, the shared ones (seed) stay."""
    keep = _kind_fields(path, kind)
    if keep is None:  # an unknown kind: validation reports it, with the old fields for context
        return
    for key in [k for k in section.value if k not in keep]:
        del section.value[key]
