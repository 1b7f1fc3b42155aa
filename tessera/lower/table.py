"""The lowering table: one entry per (op, backend), filled where each lowering is defined.

A lowering gets the small typed context, the op (its attrs already resolved for the current layer),
its value operands as arrays (axes in the order of their IR types) and its parameters by local name
(`q`, `experts/gate`), and returns its results. A stateful lowering (attention during decoding) also
gets and returns its state; `init_state` builds the empty state for a batch and a cache length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

REFERENCE = "reference"


@dataclasses.dataclass(frozen=True)
class Lowering:
    """How to lower one op: the function, and for stateful ops how to make their state."""

    op: str
    fn: Callable[..., Any]
    stateful: bool = False
    init_state: Callable[..., Any] | None = None


LOWERINGS: dict[tuple[str, str], Lowering] = {}


def lowers(op: str, *, backend: str = REFERENCE, stateful: bool = False, init_state=None):
    """Decorator: register `fn` as the lowering of `op` on `backend`; a duplicate is an error."""

    def register(fn):
        key = (op, backend)
        if key in LOWERINGS:
            raise ValueError(f"op `{op}` already has a lowering for backend `{backend}`")
        LOWERINGS[key] = Lowering(op, fn, stateful, init_state)
        return fn

    return register


def get_lowering(op: str, backend: str = REFERENCE) -> Lowering:
    """The lowering of `op` on `backend`, falling back to the reference."""
    from tessera.lower import ops_core, ops_nn  # noqa: F401  (registration happens on import)

    found = LOWERINGS.get((op, backend)) or LOWERINGS.get((op, REFERENCE))
    if found is None:
        raise NotImplementedError(f"no lowering for op `{op}`")
    return found
