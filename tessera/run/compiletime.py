"""Where a first call's compile time goes, from JAX's own duration events: tracing to a jaxpr, lowering the
jaxpr to StableHLO, and the backend's compile (XLA's passes and code generation, GPU autotuning included).

    with compile_phases() as phases:
        fn(*args)                      # the first call
    phases  # {"trace_s": 1.3, "lower_s": 1.2, "backend_s": 21.0}

and where compiled programs are kept between runs (`configure_compilation_cache`, `cache_counts`; XLA's GPU kernel
choices are kept beside them: tessera/run/environment.py, `configure_autotune_cache`).

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

from tessera.run.environment import OFF, cache_root

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "backend_s"}

_open: list[dict[str, float]] = []
_lock = threading.Lock()
_registered = False


_HITS, _SAVED = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/compile_time_saved_sec"
_cache = {"hits": 0, "saved_s": 0.0}  # programs loaded from the persistent cache by this process, seconds saved


def _listen(event: str, duration: float, **_: object) -> None:
    key = EVENTS.get(event)
    with _lock:
        if key is not None:
            for phases in _open:
                phases[key] += duration
        elif event == _SAVED:
            _cache["saved_s"] += duration


def _count(event: str, **_: object) -> None:
    if event == _HITS:
        with _lock:
            _cache["hits"] += 1


def _listening() -> None:
    """Register this module's listeners with JAX, once (JAX keeps them for the process). Call holding `_lock`."""
    global _registered
    if not _registered:
        jax.monitoring.register_event_duration_secs_listener(_listen)
        jax.monitoring.register_event_listener(_count)
        _registered = True


@contextlib.contextmanager
def compile_phases() -> Iterator[dict[str, float]]:
    """A dict of seconds per compile phase, filled while the block runs (nested blocks each count)."""
    with _lock:
        _listening()
        phases = dict.fromkeys(EVENTS.values(), 0.0)
        _open.append(phases)
    try:
        yield phases
    finally:
        with _lock:
            _open.remove(phases)


# ---- the persistent compilation cache ------------------------------------------------------------------------------

CACHE_VAR = "TESSERA_COMPILATION_CACHE"  # a directory, or off / 0 / false / no
_OFF = OFF


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/tessera/jax, by default ~/.cache/tessera/jax."""
    return cache_root() / "jax"


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
    global _setting
    _setting = _cache_setting()
    return _setting


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


_setting = {"set_by": "user", "dir": None}  # configure_compilation_cache's record, until it is called


def cache_counts() -> dict:
    """{hits, saved_s}: the programs this process has loaded from the persistent cache so far, and the compile time
    they saved (as the cache recorded it when they were compiled). Counting starts at the first call."""
    with _lock:
        _listening()
        return dict(_cache)


def cache_record(before: dict) -> dict:
    """The manifest's `compilation_cache`: where compiled programs are kept (`dir`, null when off; `set_by`) and
    how many were loaded from there since `before` (`cache_counts()` then: `hits`), and the compile seconds that
    saved (`saved_s`)."""
    now = cache_counts()
    return {**_setting, "hits": now["hits"] - before["hits"], "saved_s": round(now["saved_s"] - before["saved_s"], 3)}

