"""Where a generate row's measured peak goes beyond `tessera plan`'s total: device memory at each phase.

    python -m bench.experiments.memory_gap "20b decode b1" ["20b prefill 2048" ...]

For each bench.e2e row (a generate spec), runs it as `tessera run` does and records the device's
`bytes_in_use` / `peak_bytes_in_use` after the parameters are made, after the first (compiling) call and at
the end; the compiled generation program's memory analysis (arguments, outputs, temporaries); and the
plan's per-device breakdown. Prints one table per row: which phase sets the peak, and by how much the
plan misses each part.
"""

from __future__ import annotations

import io
import sys
import tempfile
from pathlib import Path

from tessera.run.environment import configure_allocator

configure_allocator()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

GIB = 2 ** 30


def _mem() -> tuple[float, float]:
    s = jax.devices()[0].memory_stats() or {}
    return s.get("bytes_in_use", 0) / GIB, s.get("peak_bytes_in_use", 0) / GIB


def measure(name: str) -> None:
    from bench.e2e import ROWS
    from tessera.run import plan as plan_mod
    from tessera.run.main import run_experiment
    from tessera.run.tasks import generate as gen_task
    from tessera.spec import load_experiment

    _, spec, overrides, _ = ROWS[name]
    exp = load_experiment(spec, overrides=overrides)
    phases: list[tuple[str, float, float]] = []
    seen: dict = {}
    original = gen_task.generate_all

    def generate_all(prog, params, ids, lengths, n, kw, capacity=None):
        if not phases:
            phases.append(("params made", *_mem()))
            seen.update(prog=prog, params=params, ids=ids, lengths=lengths, capacity=capacity or n)
        out = original(prog, params, ids, lengths, n, kw, capacity=capacity)
        if len(phases) == 1:
            phases.append(("after the first (compiling) call", *_mem()))
        return out

    gen_task.generate_all = generate_all
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = run_experiment(exp, out=Path(tmp) / "run", stream=io.StringIO(), tensorboard=False)
    finally:
        gen_task.generate_all = original
    phases.append(("end of run", *_mem()))
    print(f"\n## {name}\n\n| phase | in use GiB | peak GiB |\n|---|---|---|")
    for label, used, peak in phases:
        print(f"| {label} | {used:.2f} | {peak:.2f} |")

    prog, params, ids = seen["prog"], seen["params"], seen["ids"]
    from tessera.lower.sampling import SamplingRule
    length = int(seen["lengths"].max())
    fn = jax.jit(prog.generate_fn(params, ids.shape[0], seen["capacity"], SamplingRule(0.0, None, None), ()))
    stats = fn.lower(params, jnp.asarray(ids[:, :length]), jnp.asarray(0, jnp.uint32),
                     jnp.asarray(1, jnp.int32)).compile().memory_analysis()
    leaves = jax.tree_util.tree_leaves(params)
    held = sum(x.nbytes for x in leaves) / GIB
    print(f"\nparams held: {held:.2f} GiB in {len(leaves)} arrays")
    if stats is not None:
        print("compiled generation program: " + ", ".join(
            f"{k} {getattr(stats, f'{k}_size_in_bytes') / GIB:.2f} GiB" for k in ("argument", "output", "alias", "temp")))
    from tessera.spec.schema import Experiment
    plan = plan_mod.build_plan(Experiment.model_validate(result.manifest["spec"]), plan_mod.pick_device(None)[0])
    mem = plan["memory_per_device"]
    print("plan per device (GiB): " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in mem.items() if isinstance(v, (int, float))))
    for k, v in mem.items():
        if isinstance(v, dict):
            print(f"  {k}: " + ", ".join(f"{a} {b / GIB:.2f}" for a, b in v.items() if isinstance(b, (int, float))))
    print(f"manifest device_memory: {result.manifest.get('device_memory')}")


if __name__ == "__main__":
    for row in sys.argv[1:] or ["20b decode b1"]:
        measure(row)
