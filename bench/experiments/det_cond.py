"""Deterministic mode's train step with a device's canonical shards each run as a conditional's branch (`fenced`:
its gradients buffers of their own, summed from there) against the shard loop (`opaque_map`: each shard's gradients
copied into [m, ...] stacks, zero-filled first), one process a variant.

    python -m bench.experiments.det_cond [--spec specs/bench/gpt_oss_20b_layers_train.yaml] [--only loop,cond]
        [--checksum]

The profile of GPT-OSS-20B's two layers at C = 2 on one H100 (session 38: bench/SCALING.md) spent 11.7 ms writing
the shards' gradients into the stacks and 2.9 ms zero-filling them, of deterministic mode's ~37 ms over fast mode.
A conditional's results are its branch's own buffers: no stack, no copy. `--checksum` prints the parameters' sha256
after the same steps: the two forms must give the same bits (the shard's function is the same computation either
way) for "cond" to be an option on every mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.run.environment import recorded_settings, request_deterministic_kernels

# deterministic mode's XLA flags for a task that trains (as `tessera run` sets them), before JAX starts
request_deterministic_kernels(recorded_settings({"task": {"kind": "train"}}))

from bench.experiments import train_variants  # noqa: E402 (it sets the allocator and imports JAX)
from bench.experiments.lowering_variants import patched  # noqa: E402
from tessera.lower.fence import fenced  # noqa: E402
from tessera.lower.shard import deterministic  # noqa: E402


def branched_map(fn, xs, n: int):
    """opaque_map's results, each row of xs run as a conditional's branch of its own (n of them, unrolled)."""
    fn = jax.jit(fn)
    outs = [fenced(fn, jax.tree.map(lambda a, i=i: a[i], xs)) for i in range(n)]
    return jax.tree.map(lambda *v: jnp.stack(v), *outs)


def _shard_gradients_cond(fn, local, m, widths, history=None):
    with patched([(deterministic, "opaque_map", branched_map)]):
        return _SHARD_GRADIENTS(fn, local, m, widths, history)


_SHARD_GRADIENTS = deterministic.shard_gradients
VARIANTS = {"loop": [], "cond": [(deterministic, "shard_gradients", _shard_gradients_cond)]}


def main(argv=None) -> int:
    argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    if "--spec" not in argv:
        argv = ["--spec", "specs/bench/gpt_oss_20b_layers_train.yaml", *argv]
    return train_variants.main(argv, VARIANTS, ("parallel.deterministic=true",), __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
