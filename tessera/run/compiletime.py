"""Where a first call's compile time goes, from JAX's own duration events: tracing to a jaxpr, lowering the
jaxpr to StableHLO, and the backend's compile (XLA's passes and code generation, GPU autotuning included).

    with compile_phases() as phases:
        fn(*args)                      # the first call
    phases  # {"trace_s": 1.3, "lower_s": 1.2, "backend_s": 21.0}

and where compiled programs are kept between runs (`configure_compilation_cache`, `cache_counts`).

Durations are summed over every function compiled while the block is open (a program's inner jitted
functions each trace and lower once); a persistent-cache hit shows as a short backend compile.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
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


# ---- the persistent compilation cache ------------------------------------------------------------------------------

CACHE_VAR = "TESSERA_COMPILATION_CACHE"  # a directory, or off / 0 / false / no
_OFF = ("off", "0", "false", "no")


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/tessera/jax, by default ~/.cache/tessera/jax."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tessera" / "jax"


def configure_compilation_cache() -> dict:
    """Keep compiled programs on disk (JAX's persistent compilation cache), so a second run of a spec — a resumed
    or replayed run, another seed, another data file — loads its programs instead of compiling them again (on one
    H100 the fp8 Llama-1B train step compiles in ~175 s, the 120b's generation program in ~2 min). A cached program
    is the one XLA compiled for the same StableHLO, XLA flags, jax version and devices (the cache's key), so its
    numbers are the same bits. Like `configure_allocator`, this acts before the first compile and never overrides
    the person: a cache directory they set (JAX_COMPILATION_CACHE_DIR, or jax's config) is theirs to keep, and
    TESSERA_COMPILATION_CACHE=off turns it off (a directory there moves it). The cache is trusted code: keep it
    where only you can write. It has no size bound (jax's bound needs the `filelock` package, not a dependency):
    delete the directory to reclaim its space. Returns the record for the manifest."""
    configure_compilation_cache.record = record = _cache_setting()
    return record


def _cache_setting() -> dict:
    env = os.environ
    choice = env.get(CACHE_VAR, "").strip()
    if choice.lower() in _OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return {"set_by": "user", "dir": None}
    theirs = env.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir
    if theirs and not choice:
        return {"set_by": "user", "dir": str(theirs)}
    from jax.experimental.compilation_cache import compilation_cache

    path = Path(choice).expanduser() if choice else default_cache_dir()
    jax.config.update("jax_compilation_cache_dir", str(path))
    compilation_cache.reset_cache()  # jax decides once whether to use it: anything compiled before decided "no"
    return {"set_by": "user" if choice else "tessera", "dir": str(path)}


configure_compilation_cache.record = {"set_by": "user", "dir": None}  # until it is called


_cache = {"hits": 0, "saved_s": 0.0}
_cache_registered = False


def _cache_event(event: str, **_: object) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        with _lock:
            _cache["hits"] += 1


def _cache_duration(event: str, duration: float, **_: object) -> None:
    if event == "/jax/compilation_cache/compile_time_saved_sec":
        with _lock:
            _cache["saved_s"] += duration


def cache_counts() -> dict:
    """{hits, saved_s}: the programs this process has loaded from the persistent cache so far, and the compile time
    they saved (as the cache recorded it when they were compiled). Counting starts at the first call."""
    global _cache_registered
    with _lock:
        if not _cache_registered:
            jax.monitoring.register_event_listener(_cache_event)
            jax.monitoring.register_event_duration_secs_listener(_cache_duration)
            _cache_registered = True
        return dict(_cache)
