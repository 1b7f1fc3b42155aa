"""Deterministic mode's train step with a device's two canonical shards' gradients summed as they come
(`shard_loop.opaque_fold`, the default since session 38) against stacking them and tree-summing the stack (as
before), in one process a variant: the measurement that decides whether the fold stays.

    python -m bench.experiments.det_fold [--spec specs/bench/gpt_oss_20b_layers_train.yaml] [--only fold,stack]

Built on the CPU without a GPU to time it. The profile of the GPT-OSS-20B-layers step on one H100 (C = 2, 161.1 ms
of device time against fast mode's 116.3, session 38: bench/SCALING.md) spent 11.7 ms writing each shard's
gradients into the [2, ...] stacks, 8.9 ms in the tree sum's adds and 2.9 ms zero-filling the stacks. The fold
holds the fp32 sum as the loop's carry and adds each shard's gradients (past an optimization barrier) into it in
place: on the CPU, llama_tiny at d_model 256 compiled to 200.1 MB a device against 218.7 (one device, C = 2) and
50.1 against 54.7 (fsdp=4, C = 8), the 20b-layers step's temporaries 103.9 GiB against 106.0, no copy added in the
loop; the same bits (tests/lower/shard/test_shard_loop.py, and the fsdp=2 x tp=2 mesh of test_train_meshes). "stack"
patches `deterministic.folds` to never (the default spec's C = 2 on one device then stacks)."""

from __future__ import annotations

from tessera.run.environment import recorded_settings, request_deterministic_kernels

# deterministic mode's XLA flags for a task that trains (as `tessera run` sets them), before JAX starts
request_deterministic_kernels(recorded_settings({"task": {"kind": "train"}}))

from bench.experiments import train_variants  # noqa: E402 (it sets the allocator and imports JAX)
from tessera.lower.shard import deterministic  # noqa: E402

VARIANTS = {"fold": [], "stack": [(deterministic, "folds", lambda m: False)]}


def main(argv=None) -> int:
    argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    if "--spec" not in argv:
        argv = ["--spec", "specs/bench/gpt_oss_20b_layers_train.yaml", *argv]
    return train_variants.main(argv, VARIANTS, ("parallel.deterministic=true",), __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
