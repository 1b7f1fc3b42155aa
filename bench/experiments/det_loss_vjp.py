"""Deterministic mode's train step with the loss's gradient from its kept statistics (reference/losses.py: a custom
VJP keeping the log-sum-exp's maximum and sum a token, built since session 40) against the rematerialised loss the
fenced head took before (its reductions run again in the backward), and against the layers unrolled, one process.

    python -m bench.experiments.det_loss_vjp [--spec specs/bench/gpt_oss_20b_layers_train.yaml] [--only kept,remat]
        [--checksum]

"kept" is as built; "remat" patches the head's loss to `jax.checkpoint` of autodiff's (the form before); "unrolled"
is "kept" with the layers unrolled over weights split into their layers (`Deterministic.unrolls` True; built only
from C = 4), which returns each layer's gradient as a buffer of its own where the layer scan's gradient of a period's
stacked weights is a concatenation written per canonical shard (session 40's profile of GPT-OSS-20B's two layers at
C = 2: 5.2 ms a step of `add_any` fusions [2, 32, 2880, 2880]). `--checksum`: "kept" and "remat" must give the same
parameters (the same operations; tests/lower/test_reference_elementwise.py checks it on the CPU)."""

from __future__ import annotations

from tessera.run.environment import recorded_settings, request_deterministic_kernels

# deterministic mode's XLA flags for a task that trains (as `tessera run` sets them), before JAX starts
request_deterministic_kernels(recorded_settings({"task": {"kind": "train"}}))

import jax  # noqa: E402

from bench.experiments import train_variants  # noqa: E402 (it sets the allocator)
from tessera.lower.reference import losses  # noqa: E402
from tessera.lower.shard import det_pipeline, deterministic  # noqa: E402


def _remat(logits, labels):
    with jax.named_scope("loss"):
        return jax.checkpoint(losses._token_cross_entropy)(logits, labels)


VARIANTS = {"kept": [], "remat": [(det_pipeline, "token_cross_entropy", _remat)],
            "unrolled": [(deterministic.Deterministic, "unrolls", lambda self, c: True)]}


def main(argv=None) -> int:
    return train_variants.main(argv, VARIANTS, ("parallel.deterministic=true",), __doc__,
                               spec="specs/bench/gpt_oss_20b_layers_train.yaml")


if __name__ == "__main__":
    raise SystemExit(main())
