"""`tessera ir SPEC [--after PASS] [--roundtrip]`: print a spec's graph, or check that it round-trips."""

from __future__ import annotations

import difflib
import sys

from tessera.ir.parser import parse_graph
from tessera.ir.passes import PassContext, stages
from tessera.ir.printer import print_graph
from tessera.ir.verify import verify


def ir_command(spec, overrides=(), after: str | None = None, roundtrip: bool = False) -> int:
    """Print the graph after pass `after` (default: as elaborated); with roundtrip, check every pass."""
    from tessera.ir.check import experiment_graph
    from tessera.spec import load_experiment

    exp = load_experiment(spec, overrides=overrides)
    graph = experiment_graph(exp)
    ctx = PassContext.of(exp)
    if not roundtrip:
        if after is not None:
            graph = next(g for name, g in stages(graph, ctx, after) if name == after)
        print(print_graph(graph), end="")
        return 0
    for name, g in stages(graph, ctx, after):
        text = print_graph(g)
        again = print_graph(verify(parse_graph(text, f"<{name}>")))
        if again != text:
            diff = difflib.unified_diff(text.splitlines(), again.splitlines(), "printed", "reparsed", lineterm="")
            print(f"tessera ir: after `{name}` the graph does not round-trip:", file=sys.stderr)
            print("\n".join(diff), file=sys.stderr)
            return 1
        print(f"{name}: ok")
    return 0
