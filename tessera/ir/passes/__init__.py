"""Named passes and the pipeline. Each pass is `fn(graph, ctx) -> graph` (pure: it returns a new graph),
registered under a name the command line uses (`tessera ir SPEC --after fuse`). The verifier runs after
every pass.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterator

from tessera.diagnostics import TesseraError, did_you_mean, error
from tessera.ir.types import Graph

Pass = Callable[[Graph, "PassContext"], Graph]


@dataclasses.dataclass
class PassContext:
    """What passes may read besides the graph, built once from the spec (`PassContext.of`): the numeric policy
    and the logical -> mesh axis rules on the spec's mesh. Passes see these, never the whole experiment."""

    numerics: Any = None  # spec Numerics (or {"default": "bf16 @accum(fp32)", "params": ..., "rules": {...}})
    rules: Any = None  # tessera.ir.passes.shard.AxisRules on the spec's mesh; None: the shard pass annotates nothing

    @classmethod
    def of(cls, exp) -> "PassContext":
        """The context of an experiment: its numerics and its mesh's axis rules."""
        from tessera.ir.passes.shard import AxisRules

        return cls(numerics=exp.numerics, rules=AxisRules.from_experiment(exp))


PASSES: dict[str, Pass] = {}


def register_pass(name: str, fn: Pass) -> Pass:
    """Add a named pass; a duplicate name is an error."""
    if name in PASSES:
        raise ValueError(f"pass `{name}` is registered twice")
    PASSES[name] = fn
    return fn


def _verify(graph: Graph, ctx: PassContext) -> Graph:
    from tessera.ir.verify import verify

    return verify(graph)


def _load() -> None:
    from tessera.ir.passes import canonicalize, decompose, fuse, numerics, shard  # noqa: F401


register_pass("verify", _verify)

# The pipeline, in order. Later stages (shard, lower) are appended by the layers that own them.
PIPELINE: list[str] = ["verify", "canonicalize", "decompose", "fuse", "numerics"]
PIPELINE.append("shard")  # tessera/ir/passes/shard.py: mesh axes per dim from parallel.rules


def run_pass(name: str, graph: Graph, ctx: PassContext | None = None) -> Graph:
    """Run one named pass on a copy of `graph`, then verify the result."""
    from tessera.ir.verify import verify

    _load()
    if name not in PASSES:
        hint = did_you_mean(name, PASSES)
        raise error(f"unknown pass `{name}`", hint=hint or f"passes: {', '.join(PIPELINE)}")
    return verify(PASSES[name](copy.deepcopy(graph), ctx or PassContext()))


def stages(graph: Graph, ctx: PassContext | None = None, upto: str | None = None) -> Iterator[tuple[str, Graph]]:
    """(pass name, graph after it) for each pipeline pass, stopping after `upto`."""
    _load()
    if upto is not None and upto not in PIPELINE:
        hint = did_you_mean(upto, PIPELINE)
        raise error(f"unknown pass `{upto}`", hint=hint or f"passes: {', '.join(PIPELINE)}")
    for name in PIPELINE:
        graph = run_pass(name, graph, ctx)
        yield name, graph
        if name == upto:
            return


def run_pipeline(graph: Graph, upto: str | None = None, ctx: PassContext | None = None) -> Graph:
    """The graph after every pipeline pass up to and including `upto` (all when None)."""
    for _, graph in stages(graph, ctx, upto):
        pass
    return graph


__all__ = ["PASSES", "PIPELINE", "PassContext", "TesseraError", "register_pass", "run_pass", "run_pipeline",
           "stages"]
