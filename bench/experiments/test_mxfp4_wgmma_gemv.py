"""bench/experiments/mxfp4_wgmma_gemv.py on the CPU: its integer route from E2M1 codes and E8M0 scales to bf16 bits is the
reference's values (the kernel itself is work in progress: its module docstring)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bench.experiments.mxfp4_wgmma_gemv import _bf16_bits
from tessera.lower.reference import mxfp4 as ref


def test_integer_bits_are_the_reference_values():
    nib = np.arange(16, dtype=np.int32)[:, None]
    scale = np.arange(2, 253, dtype=np.int32)[None, :]
    bits = np.asarray(_bf16_bits(jnp.asarray(nib), jnp.asarray(scale))).astype(np.uint16)
    got = np.asarray(jnp.asarray(bits).view(jnp.bfloat16).astype(jnp.float32))
    want = np.asarray(ref.E2M1, np.float64)[:, None] * np.exp2(scale.astype(np.float64) - 127)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    np.testing.assert_array_equal(np.signbit(got[8]), True)  # -0 stays -0
