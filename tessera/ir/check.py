"""Model-level checks of an experiment: elaborate its model, then small named checks against the spec.

Each check returns diagnostics that point into both files where it can: the spec key that is wrong
and the model-source op that owns the tensor it is wrong about.
"""

from __future__ import annotations

import fnmatch
import math

from tessera.diagnostics import Diagnostic, TesseraError
from tessera.ir.types import Graph


def _mesh_axes(rule) -> list[str]:
    return [] if rule is None else [rule] if isinstance(rule, str) else list(rule)


def _divisors(n: int) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, ds[:6])) + (" ..." if len(ds) > 6 else "")


def check_mesh_divides(exp, graph: Graph) -> list[Diagnostic]:
    """Every mesh axis product that shards a param dim divides the dim's size."""
    sizes, rules, out, seen = exp.mesh.axes, exp.parallel.rules, [], set()
    for p in graph.params.values():
        for d in p.type.dims:
            axes = _mesh_axes(rules.get(d.name))
            shards = math.prod(sizes[a] for a in axes)
            if d.size is None or shards <= 1 or d.size % shards == 0 or (d.name, shards) in seen:
                continue
            seen.add((d.name, shards))
            where = " × ".join(f"{a}={sizes[a]}" for a in axes if sizes[a] > 1)
            key = f"parallel.rules.{d.name}"
            span = exp.span(key) or next((exp.span(f"mesh.{a}") for a in axes if exp.span(f"mesh.{a}")), None)
            out.append(Diagnostic(f"{where} does not divide `{d.name}` = {d.size} (param `{p.path}`)", span=span,
                                  key=key, hint=f"use a mesh size that divides {d.size}: {_divisors(d.size)}"))
            if p.span is not None:
                out.append(Diagnostic(f"`{p.path}` is declared here with `{d.name}` = {d.size}", span=p.span,
                                      severity="note"))
    return out


def check_numeric_rules(exp, graph: Graph) -> list[Diagnostic]:
    """Every numerics rule matches at least one parameter path."""
    out = []
    for glob in (exp.numerics.rules or {}):
        if not any(fnmatch.fnmatchcase(path, glob) for path in graph.params):
            out.append(Diagnostic(f"numeric rule `{glob}` matches no parameter of model `{graph.name}`",
                                  span=exp.span(f"numerics.rules.{glob}") or exp.span("numerics.rules"),
                                  key=f"numerics.rules", hint="parameter paths look like " +
                                  ", ".join(list(graph.params)[:3])))
    return out


COMPUTE_TYPES = ("fp32", "bf16", "fp16")  # what activations can be computed in (tessera/lower/context.py)


def check_compute_type(exp, graph: Graph) -> list[Diagnostic]:
    """The compute type (`numerics.default`) is one the lowering computes in. Narrower types are storage
    formats here: a parameter may be held in them (`numerics.rules`), not computed in."""
    base = exp.numerics.default.base
    if base in COMPUTE_TYPES:
        return []
    return [Diagnostic(f"`{base}` is a storage format, not a type activations can be computed in",
                       span=exp.span("numerics.default"), key="numerics.default",
                       hint=f"compute in {', '.join(COMPUTE_TYPES)} (e.g. `bf16 @accum(fp32)`); parameters can be "
                            f"held in `{base}` with numerics.rules")]


CHECKS = [check_mesh_divides, check_numeric_rules, check_compute_type]


def experiment_graph(exp) -> Graph:
    """The experiment's model elaborated and verified, errors pointing into the spec where args come from."""
    from tessera.ir.elaborate import build_graph

    return build_graph(exp.model.file, dict(exp.model.args), arg_span=lambda n: exp.span(f"model.args.{n}"),
                       arg_key_span=lambda n: exp.key_span(f"model.args.{n}"))


def check_experiment(exp) -> Graph:
    """Elaborate exp's model, run the pipeline, and run CHECKS; raise TesseraError listing all problems."""
    from tessera.ir.passes import PassContext, run_pipeline

    graph = experiment_graph(exp)
    problems = [d for check in CHECKS for d in check(exp, graph)]
    if problems:
        raise TesseraError(problems)
    return run_pipeline(graph, ctx=PassContext(numerics=exp.numerics, experiment=exp))
