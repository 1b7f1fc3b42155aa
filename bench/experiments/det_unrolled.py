"""Deterministic mode's train step with its layers unrolled over weights split into their layers (as built since
session 36) against the layer scan it had before, in one process: the measurement that decides whether it stays.

    python -m bench.experiments.det_unrolled [--spec specs/bench/llama_1b_train.yaml] [--set KEY=VALUE ...]
        [--only scan,unrolled] [--steps 5]

On one GPU a deterministic step runs its C canonical shards one after another. Session 36's profile of the
Llama-1B step (one H200, `tessera profile`, C = 8 against C = 1: 364.5 against 266.6 ms of device time; fast mode
260.4 ms a step, C = 2 292.1, C = 8 371.2; the deterministic flag's untimed kernel choice 369.9 against 371.2 with
XLA's timed one) put the shards' extra cost in data movement: ~19 ms of MemcpyD2D copying each layer's slice of
every stacked weight a GEMM reads (352 copies a shard: 16 layers x 22), ~28 ms writing the shards' gradients into
their stacks, ~9 ms of zero-filled stacked-gradient buffers of the backward scan, and the rest in GEMMs and
attention on 2,048-row shards. The built form (`Deterministic.unrolled`) splits the precast weights into their
layers once before the shard loop (layerwise.split) and runs the repeat unrolled (`LowerCtx.unroll`), each layer
rematerialised as the scan's body was and fenced (tessera/lower/fence.py: on the CPU, unfenced, attention's q and k
gradients came a bit apart on dp=2 and one device), so a GEMM reads its weight in place and each layer's gradient
is its own buffer. On the CPU its one-device bits are the scan's for llama_tiny (fp32 and bf16) and gpt_oss_tiny in
fp32 (gpt_oss_tiny in bf16 moved), and every mesh of the test suite is one device's bits. "scan" patches
`Deterministic.unrolled` to False. Each variant is timed as `tessera run`'s bench task times `train_step`; the
peak device memory printed is the process's so far (run `--only scan` and `--only unrolled` apart to compare it).
Not measured on a GPU yet (session 36 had no device time left): run this before anything else.
"""

from __future__ import annotations

import argparse

from tessera.run.environment import configure_allocator, request_deterministic_kernels

request_deterministic_kernels(None)  # deterministic mode's XLA flags (as `tessera run` sets them), before JAX starts
configure_allocator()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.experiments.lowering_variants import patched  # noqa: E402
from tessera.lower.shard import deterministic  # noqa: E402


VARIANTS = {"scan": [(deterministic.Deterministic, "unrolled", property(lambda self: False))], "unrolled": []}


def main(argv=None) -> int:
    from tessera.lower import program
    from tessera.lower.program import compile_experiment
    from tessera.run.optim import build_optimizer, current_lr
    from tessera.run.tasks.bench import time_calls
    from tessera.spec import load_experiment

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="specs/bench/llama_1b_train.yaml")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--only", default=None)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(VARIANTS)
    exp = load_experiment(args.spec, ["parallel.deterministic=true", *args.set])
    b, s = int(exp.task.batch), int(exp.task.seq_len)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {args.spec} {args.set}, batch {b} x {s}", flush=True)
    tokens = np.random.default_rng(0).integers(0, compile_experiment(exp).vocab, (b, s), dtype=np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "mask": np.ones((b, s), np.float32)}
    times = {}
    for name in names:
        with patched(VARIANTS[name]):
            program._PROGRAMS.clear()  # a Program of its own: programs are cached on the spec's hash
            prog = compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)  # as `tessera run`
            holder = [prog.init_train_state(prog.init(0))]

            def step(prog=prog, holder=holder):
                holder[0], m = prog.train_step(holder[0], batch)
                return m["loss"]

            t = time_calls(step, 2, args.steps)
            loss = float(step())
        del holder[:]  # the state freed before the next variant compiles
        times[name] = t["median_s"]
        stats = jax.devices()[0].memory_stats() or {}  # the process's peak so far: one variant a process (--only)
        peak = f", peak {stats['peak_bytes_in_use'] / 2 ** 30:.1f} GiB" if "peak_bytes_in_use" in stats else ""
        print(f"{name:<12} {t['median_s'] * 1e3:8.2f} ms a step (spread {t['min_s'] * 1e3:.2f}-{t['max_s'] * 1e3:.2f}), "
              f"compile {t['compile_s']:.1f} s, loss after {args.steps + 4} steps {loss:.6f}{peak}", flush=True)
    for name in names:
        print(f"{name:<12} {times[names[0]] / times[name]:5.3f}x {names[0]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
