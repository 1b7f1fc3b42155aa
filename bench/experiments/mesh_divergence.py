"""Where a deterministic run on a CPU mesh stops being bit-identical to one device: per parameter, after each step.

    python -m bench.experiments.mesh_divergence SPEC [--mesh ep=2] [--steps 3] [--set KEY=VALUE ...] [--xla FLAGS]

Trains SPEC (a train spec; `--set` overrides, e.g. a smaller data set) for `--steps` deterministic steps on one
device and on the given mesh, in one process with 8 host devices, compiled with the XLA flags `tessera run` sets in
deterministic mode, and prints after each step the parameters and optimizer moments that differ, by how much and in
how many elements. Adam's first step is sign-like (m/sqrt(v) = +-1), so the moments (`mu`, `nu`) show a gradient
difference a step before the parameters do; a moment that differs while the gradients agree is the update's own
rounding (docs/parallel.md: ep=2's fused update). `--xla` adds XLA flags (for instance
`--xla_backend_optimization_level=0`, the test suite's quick compile, under which XLA:CPU's fma contraction did
not show).
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--mesh", default="ep=2", help="axis=size[,axis=size]")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--xla", default="", help="extra XLA flags")
    args = ap.parse_args()
    from tessera.run.environment import DETERMINISTIC_CPU_THREADS, DETERMINISTIC_XLA_FLAGS  # before JAX starts

    os.environ["XLA_FLAGS"] = " ".join(["--xla_force_host_platform_device_count=8", *DETERMINISTIC_XLA_FLAGS,
                                        args.xla]).strip()
    os.environ.setdefault("PJRT_NPROC", DETERMINISTIC_CPU_THREADS)  # as `tessera run` in deterministic mode

    import jax
    import numpy as np
    import yaml

    from tessera.lower.program import compile_experiment
    from tessera.run.optim import build_optimizer, current_lr
    from tessera.run.pde import BurgersSource
    from tessera.spec import load_experiment

    base = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    mesh = {f"mesh.{a}": int(n) for a, n in (s.split("=") for s in args.mesh.split(","))}
    runs = {}
    for name, extra in (("one device", {}), (args.mesh, mesh)):
        exp = load_experiment(args.spec, overrides={**base, **extra})
        prog = compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)
        if exp.task.data.kind != "burgers":
            sys.exit("this probe feeds Burgers pairs (tessera.run.pde.BurgersSource); add the spec's data kind")
        source = BurgersSource(exp.task.data, exp.task.batch)
        state = prog.init_train_state(prog.init(0))
        snaps = []
        for n in range(args.steps):
            state, _ = prog.train_step(state, source.batch(n))
            leaves = jax.tree_util.tree_leaves_with_path((state.params, state.opt_state))
            snaps.append({jax.tree_util.keystr(p): np.asarray(jax.device_get(v)) for p, v in leaves})
        runs[name] = snaps
    one, other = runs.values()
    first = None
    for n, (a, b) in enumerate(zip(one, other), start=1):
        same = {k: a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a}
        bad = {k: (float(np.max(np.abs(a[k].astype(np.float64) - b[k]))), int(np.sum(a[k] != b[k])), a[k].size)
               if a[k].shape == b[k].shape else (float("nan"), a[k].size, a[k].size)
               for k, ok in same.items() if not ok}
        first = first or (n if bad else None)
        print(f"after step {n}: {len(bad)} of {len(same)} arrays differ" + "".join(
            f"\n  {k}: max {d:.3g}, {c} of {size} elements" for k, (d, c, size) in sorted(bad.items())))
    print(f"{args.mesh}: " + (f"departs from one device at step {first}" if first else
                              f"bit-identical to one device over {len(one)} steps (params and optimizer state)"))


if __name__ == "__main__":
    main()
