"""The train step with the cross-entropy's label logit selected by comparison (`losses.token_cross_entropy` since
session 38) against gathered (`take_along_axis`, as before), one process a variant: the measurement that decides
whether the selection stays.

    python -m bench.experiments.loss_select [--spec specs/bench/gpt_oss_20b_layers_train.yaml] [--set ...]
        [--only select,gather]

Built on the CPU without a GPU to time it. One H100's profile of GPT-OSS-20B's two layers in fast mode (session
38: bench/SCALING.md) spent 6.5 ms in the loss's backward: a multiply fusion writing the fp32 [8192, 201088]
cotangent (3.3 ms), the gather's transposed scatter updating it in place, and a separate cast to bf16 reading it
again (3.2 ms). Selected by comparison, the cotangent's arithmetic and the cast are one fusion on the CPU (the same
bits: tests/lower/test_reference_elementwise.py); on the GPU ~4 ms a step and an fp32 [tokens, vocab] buffer are
expected saved, unmeasured. "gather" patches the gathered form back in everywhere the loss is lowered."""

from __future__ import annotations

import sys

from tessera.run.environment import recorded_settings, request_deterministic_kernels

# deterministic mode's XLA flags when the person asks for that mode (as `tessera run` sets them), before JAX starts
if "parallel.deterministic=true" in sys.argv:
    request_deterministic_kernels(recorded_settings({"task": {"kind": "train"}}))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.experiments import train_variants  # noqa: E402 (it sets the allocator and imports JAX)
from tessera.lower import ops_core  # noqa: E402
from tessera.lower.reference import losses  # noqa: E402
from tessera.lower.shard import det_pipeline, deterministic  # noqa: E402


def gathered(logits, labels):
    """token_cross_entropy as built before session 38: the label's logit gathered."""
    with jax.named_scope("loss"):
        lf = logits.astype(jnp.float32 if logits.dtype != jnp.float64 else logits.dtype)
        lse = jax.nn.logsumexp(lf, axis=-1)
        return lse - jnp.take_along_axis(lf, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]


VARIANTS = {"select": [],
            "gather": [(m, "token_cross_entropy", gathered) for m in (losses, ops_core, det_pipeline, deterministic)]}


def main(argv=None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    if "--spec" not in argv:
        argv = ["--spec", "specs/bench/gpt_oss_20b_layers_train.yaml", *argv]
    return train_variants.main(argv, VARIANTS, (), __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
