"""Golden sharding snapshots: every parameter's logical axes, mesh spec and per-device shape on a mesh."""

from __future__ import annotations

from tessera.lower.shard.rules import AxisRules


def sharding_snapshot(exp, graph) -> dict:
    """{mesh, rules, params: {path: {axes, mesh, shape, local_shape}}} for exp's mesh (plain JSON data)."""
    rules = AxisRules.from_experiment(exp)
    params = {}
    for path, p in graph.params.items():
        shape = tuple(d.size for d in p.type.dims)
        params[path] = {"axes": list(p.type.names),
                        "mesh": ["*".join(a) if a else None for a in rules.dims(p.type.names)],
                        "shape": list(shape), "local_shape": list(rules.local_shape(p.type.names, shape))}
    return {"mesh": {a: n for a, n in exp.mesh.axes.items() if n > 1},
            "rules": {k: list(v) for k, v in rules.rules}, "params": params}
