"""`load_experiment`: YAML (+ extends, + overrides) → validated, frozen `Experiment`, or every problem at once."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Iterable, Mapping

from pydantic import ValidationError

from tessera.diagnostics import Diagnostic, Span, TesseraError, relpath
from tessera.spec import checks, errors
from tessera.spec.compose import apply_overrides, load_tree, parse_overrides
from tessera.spec.files import FILE_KEYS
from tessera.spec.schema import DEFAULT_RULES, MESH_AXES, Experiment
from tessera.spec.source import Node


def load_experiment(path: str | Path, overrides: Iterable[str] | Mapping[str, Any] | None = ()) -> Experiment:
    """Load, merge, override and validate a spec file; raises TesseraError listing every problem."""
    path = Path(path)
    if not path.is_file():
        raise TesseraError(Diagnostic(f"spec file not found: {path}"))
    soft: list[Diagnostic] = []  # problems that still leave a tree to validate (duplicate keys)
    root = load_tree(path, path.resolve().parent, soft=soft)
    try:
        parsed = parse_overrides(overrides)
        _auto_mesh(root, parsed)
        apply_overrides(root, parsed)
    except TesseraError as exc:
        raise TesseraError(_sorted(soft + exc.diagnostics)) from None
    spans = {p: n.span for p, n in root.walk() if p}  # what was written somewhere; derived values are not
    key_spans = {p: n.key_span for p, n in root.walk() if p and n.key_span is not None}
    _fill_derived(root, path)
    problems = soft + _resolve_files(root)
    try:
        exp = Experiment.model_validate(root.plain())
    except ValidationError as exc:
        problems += errors.from_validation(exc, root, Experiment)
        raise TesseraError(_sorted(problems)) from None
    for key, message, hint in checks.run_checks(exp):
        node = _node_at(root, key)
        problems.append(Diagnostic(message, node.span if node else None, errors.key_path(key), hint))
    if problems:
        raise TesseraError(_sorted(problems))
    exp._spans, exp._key_spans = spans, key_spans
    return exp


def _auto_mesh(root: Node, overrides: list) -> None:
    """`mesh: auto` as the mapping {auto: true}, so that `--set mesh.tp=1` applies to it: an axis set from the
    command line makes the mesh explicit (auto off), as an explicit mesh always wins."""
    mesh = root.value.get("mesh") if isinstance(root.value, dict) else None
    if mesh is None or mesh.value != "auto":
        return
    if any(len(key) == 2 and key[0][0] == "mesh" and key[1][0] in MESH_AXES for key, _ in overrides):
        root.value["mesh"] = Node({}, mesh.span, mesh.key_span)
    else:
        root.value["mesh"] = Node({"auto": Node(True, mesh.span)}, mesh.span, mesh.key_span)


def _fill_derived(root: Node, path: Path) -> None:
    """Values derived from others before validation: the default name, unlisted sharding rules."""
    if "name" not in root.value:
        root.value["name"] = Node(path.stem, Span(relpath(path), 1, 1))
    rules = _node_at(root, ("parallel", "rules"))
    if rules is not None and isinstance(rules.value, dict):
        for axis, rule in DEFAULT_RULES.items():  # logical axes the user did not map keep their default
            if axis not in rules.value:
                rules.value[axis] = Node(rule if not isinstance(rule, list) else [Node(r, rules.span) for r in rule],
                                         rules.span)


def _resolve_files(root: Node) -> list[Diagnostic]:
    """Make file paths absolute (relative to the spec file that wrote them) and check they exist."""
    problems = []
    for key in FILE_KEYS:
        node = _node_at(root, key)
        if node is None or not isinstance(node.value, str) or not node.value:
            continue
        from_set = node.span.file.startswith("<")
        try:
            written = Path(node.value).expanduser()
        except RuntimeError:  # `~name/...` for a user this machine does not know (or no home directory)
            problems.append(Diagnostic(f"cannot expand `{node.value.split('/')[0]}`: no such user or home directory",
                                       node.span, errors.key_path(key), "write the path out, or relative to the spec"))
            continue
        base = Path.cwd() if from_set else Path(node.span.file).parent
        resolved = (base / written).resolve() if not written.is_absolute() else written
        if not resolved.is_file():
            hint = "relative to the working directory" if from_set else "relative to the spec file that names them"
            problems.append(Diagnostic(f"no such file: {relpath(resolved)}", node.span, errors.key_path(key),
                                       f"paths are {hint}"))
        node.value = str(resolved)
    return problems


def _node_at(root: Node, key: tuple) -> Node | None:
    node = root
    for part in key:
        if isinstance(node.value, dict) and part in node.value:
            node = node.value[part]
        elif isinstance(node.value, list) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            return None
    return node


def _sorted(problems: list[Diagnostic]) -> list[Diagnostic]:
    def order(d: Diagnostic) -> tuple:
        s = d.span
        return (s is None, s.file.startswith("<") if s else True, s.file if s else "", s.line if s else 0,
                s.col if s else 0)

    unique: dict[str, Diagnostic] = {}
    for d in sorted(problems, key=order):
        unique.setdefault(d.render(), d)
    return list(unique.values())


def summary(exp: Experiment) -> str:
    """A few lines describing a valid experiment, as `tessera check` prints them."""
    args = textwrap.fill(" ".join(f"{k}={v}" for k, v in exp.model.args.items()), width=100,
                         initial_indent="  args      ", subsequent_indent=" " * 12)
    mesh = " ".join(f"{k}={v}" for k, v in exp.mesh.axes.items() if v > 1) or "single device"
    if exp.mesh.auto:
        mesh = "auto (chosen by `tessera run` from the devices present and the plan"
    num = exp.numerics
    lines = [
        f"{exp.name}: ok (spec {exp.spec_hash[:12]})",
        f"  model     {relpath(exp.model.file)}",
        *([args] if exp.model.args else []),
        f"  mesh      {mesh})" if exp.mesh.auto else
        f"  mesh      {mesh} -> {exp.mesh.size} device{'s' if exp.mesh.size > 1 else ''}",
        f"  numerics  {num.default}; params {num.params}" + (f"; {len(num.rules)} rule(s)" if num.rules else "")
        + (f"; loss scale {num.loss_scale}" if num.loss_scale != "none" else ""),
        f"  task      {_task_line(exp)}",
    ]
    return "\n".join(lines) + "\n"


def _task_line(exp: Experiment) -> str:
    t = exp.task
    if t.kind == "train":
        return (f"train {t.steps} steps, batch {t.batch} x {t.seq_len} tokens, {t.optimizer.name} lr {t.optimizer.lr}"
                f", data {t.data.kind}" + (f"/{t.data.task}" if t.data.kind == "synthetic" else ""))
    if t.kind == "generate":
        how = "greedy" if t.sampling.temperature == 0 else f"temperature {t.sampling.temperature}"
        return f"generate {len(t.prompts)} prompt(s), {t.max_new_tokens} new tokens, {how}"
    if t.kind == "forward":
        source = f"{len(t.tokens)} row(s)" if t.tokens else relpath(t.tokens_file)
        return f"forward {source} -> {t.out}"
    return f"bench {', '.join(t.what)}: batch {t.batch} x {t.seq_len}, {t.iters} iters"

