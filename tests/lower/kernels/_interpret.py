"""One compile per kernel for the Mosaic GPU interpreter, shared by its threads and grid points.

The interpreter (jax 0.10/0.11) runs a kernel's grid points one after another, each as one thread
per warpgroup, and every thread lowers and compiles the kernel's jaxpr anew
(`thread_map._run_jaxpr` calls `.lower().compile()`, which no cache serves): a flash attention
forward on one CTA compiled the same program three times, its dQ kernel three times a grid point.
On 2 CPU cores that compile was most of a thread's time (4-7 s of 5-8 s at XLA's default
optimisation). `share_compiles` compiles each (jaxpr, argument shapes) once and runs that
executable in every thread; what each thread runs, and the interpreter's checks (barriers, races,
bounds), are unchanged. Where jax no longer has the function, the fixture leaves the interpreter
alone: the tests pass, only slower.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest


def _shared_run_jaxpr(cache: dict, lock: threading.Lock):
    import jax.core as jax_core

    def run(jaxpr, consts, *args):
        def body(jaxpr, consts, *args):
            jax_core.eval_jaxpr(jaxpr, consts, *args)
        # the entry keeps `jaxpr` alive, so its id is not reused while the cache holds it
        key = (id(jaxpr), *((np.shape(x), np.asarray(x).dtype) for x in jax.tree.leaves((consts, args))))
        with lock:
            entry = cache.setdefault(key, {"jaxpr": jaxpr, "lock": threading.Lock(), "exe": None})
        with entry["lock"]:  # the grid point's other threads wait for the one compile
            if entry["exe"] is None:
                entry["exe"] = jax.jit(body, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
        entry["exe"](consts, *args)
    return run


@pytest.fixture(scope="module", autouse=True)
def share_compiles():
    """Autouse in the modules that import it: the interpreter compiles each kernel once per module."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        thread_map = None
    if thread_map is None or not hasattr(thread_map, "_run_jaxpr"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(thread_map, "_run_jaxpr", _shared_run_jaxpr({}, threading.Lock()))
        yield
