"""Where a first call's compile time goes, from JAX's own duration events: tracing to a jaxpr, lowering the
jaxpr to StableHLO, and the backend's compile (XLA's passes and code generation, GPU autotuning included).

    with compile_phases() as phases:
        fn(*args)                      # the first call
    phases  # {"trace_s": 1.3, "lower_s": 1.2, "backend_s": 21.0}

Durations are summed over every function compiled while the block is open (a program's inner jitted
functions each trace and lower once); a persistent-cache hit shows as a short backend compile.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import jax

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "backend_s"}

_open: list[dict[str, float]] = []
_lock = threading.Lock()
_registered = False


def _listen(event: str, duration: float, **_: object) -> None:
    key = EVENTS.get(event)
    if key is not None:
        with _lock:
            for phases in _open:
                phases[key] += duration


@contextlib.contextmanager
def compile_phases() -> Iterator[dict[str, float]]:
    """A dict of seconds per compile phase, filled while the block runs (nested blocks each count)."""
    global _registered
    with _lock:
        if not _registered:  # JAX keeps its listeners for the process: register once
            jax.monitoring.register_event_duration_secs_listener(_listen)
            _registered = True
        phases = dict.fromkeys(EVENTS.values(), 0.0)
        _open.append(phases)
    try:
        yield phases
    finally:
        with _lock:
            _open.remove(phases)
