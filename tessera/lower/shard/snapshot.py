"""Golden sharding snapshots: every parameter's logical axes, mesh spec and per-device shape on a mesh."""

from __future__ import annotations

from tessera.lower.options import CompileOptions
from tessera.lower.shard.rules import annotated_axes


def sharding_snapshot(options: CompileOptions, graph) -> dict:
    """{mesh, rules, params: {path: {axes, mesh, shape, local_shape}}} for the options' mesh (plain JSON data): each
    parameter as the program places it, by the annotations of the compiled graph (`graph`)."""
    rules = options.rules
    params = {}
    for path, p in graph.params.items():
        shape = tuple(d.size for d in p.type.dims)
        axes = annotated_axes(p.type)
        params[path] = {"axes": list(p.type.names), "mesh": ["*".join(a) if a else None for a in axes],
                        "shape": list(shape), "local_shape": [n // rules.size(a) for n, a in zip(shape, axes)]}
    return {"mesh": {a: n for a, n in options.mesh_axes.items() if n > 1},
            "rules": {k: list(v) for k, v in rules.rules}, "params": params}
