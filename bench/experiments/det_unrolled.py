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
attention on 2,048-row shards. The unrolled form (`Deterministic.unrolls`) splits the precast weights into their
layers once before the shard loop (layerwise.split) and runs the repeat unrolled (`LowerCtx.unroll`), each layer
rematerialised as the scan's body was and fenced (tessera/lower/fence.py: on the CPU, unfenced, attention's q and k
gradients came a bit apart on dp=2 and one device), so a GEMM reads its weight in place and each layer's gradient
is its own buffer. On the CPU its one-device bits are the scan's for llama_tiny (fp32 and bf16) and gpt_oss_tiny in
fp32 (gpt_oss_tiny in bf16 moved), and every mesh of the test suite is one device's bits. "scan" patches
`Deterministic.unrolls` to False, "unrolled" to True. Each variant is timed by train_variants' loop (as `tessera run`'s bench task
times `train_step`); the peak device memory printed is the process's so far (run `--only scan` and `--only
unrolled` apart to compare it).
Measured (session 37, one H100, jax 0.11.2, 279e543, batch 8 x 2048, C = 8): scan 410.14 ms a step, unrolled
381.99 (peak 44.8 GiB both; fast mode 277.13 in the same session): the unrolled form stays. With XLA's DotMerger off
as well (`--xla_gpu_dot_merger_threshold_mb=0`, now deterministic training's flag: environment.py) unrolled took
357.49 ms. GPT-OSS-20B's two layers (specs/bench/gpt_oss_20b_layers_train.yaml, C = 2): scan 170.27 ms, unrolled
179.26 (180.79 with the DotMerger on): so the shard loop unrolls from C = 4 (`UNROLL_FROM`).
"""

from __future__ import annotations

from tessera.run.environment import recorded_settings, request_deterministic_kernels

# deterministic mode's XLA flags for a task that trains (as `tessera run` sets them), before JAX starts
request_deterministic_kernels(recorded_settings({"task": {"kind": "train"}}))

from bench.experiments import train_variants  # noqa: E402 (it sets the allocator and imports JAX)
from tessera.lower.shard import deterministic  # noqa: E402

VARIANTS = {"scan": [(deterministic.Deterministic, "unrolls", lambda self, c: False)],
            "unrolled": [(deterministic.Deterministic, "unrolls", lambda self, c: True)]}


def main(argv=None) -> int:
    return train_variants.main(argv, VARIANTS, ("parallel.deterministic=true",), __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
