"""Deterministic mode's train step with a device's canonical shards each run as a conditional's branch
(`shard_loop.per_shard`, built since session 39: its gradients buffers of their own) against the shard loop
(`opaque_map`: each shard's gradients copied into [m, ...] stacks, zero-filled first), one process a variant.

    python -m bench.experiments.det_cond [--spec specs/bench/gpt_oss_20b_layers_train.yaml] [--only branches,loop]
        [--checksum]

Measured (session 39, one H100, jax 0.11.2, GPT-OSS-20B's two layers at C = 2, batch 2 x 4096): branches 146.15 ms
a step, peak 49.6 GiB; loop 154.45 ms, 54.2 GiB; the same parameters' sha256 after 9 steps. "loop" sets
`shard_loop.BRANCHED_UP_TO` to 0. `--checksum` prints the parameters' sha256 after the same steps: the two forms
must give the same bits (the shard's function is the same computation either way)."""

from __future__ import annotations

from tessera.run.environment import recorded_settings, request_deterministic_kernels

# deterministic mode's XLA flags for a task that trains (as `tessera run` sets them), before JAX starts
request_deterministic_kernels(recorded_settings({"task": {"kind": "train"}}))

from bench.experiments import train_variants  # noqa: E402 (it sets the allocator and imports JAX)
from tessera.lower.shard import shard_loop  # noqa: E402

VARIANTS = {"branches": [], "loop": [(shard_loop, "BRANCHED_UP_TO", 0)]}


def main(argv=None) -> int:
    return train_variants.main(argv, VARIANTS, ("parallel.deterministic=true",), __doc__,
                               spec="specs/bench/gpt_oss_20b_layers_train.yaml")


if __name__ == "__main__":
    raise SystemExit(main())
