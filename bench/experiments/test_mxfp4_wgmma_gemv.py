"""bench/experiments/mxfp4_wgmma_gemv.py on the CPU: its integer route from E2M1 codes and E8M0 scales to bf16 bits is
the reference's values; interpreted, MXFP4 (token, expert) pairs equal the fp32 product of the dequantised weights
(K split, a repeated expert); and the kernel passes Mosaic GPU's lowering for Hopper at GPT-OSS-20B's gate+up shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.experiments.mxfp4_wgmma_gemv import WgmmaPairConfig, _bf16_bits, pair_gemv
from tessera.lower.reference import mxfp4 as ref


def test_integer_bits_are_the_reference_values():
    nib = np.arange(16, dtype=np.int32)[:, None]
    scale = np.arange(2, 253, dtype=np.int32)[None, :]
    bits = np.asarray(_bf16_bits(jnp.asarray(nib), jnp.asarray(scale))).astype(np.uint16)
    got = np.asarray(jnp.asarray(bits).view(jnp.bfloat16).astype(jnp.float32))
    want = np.asarray(ref.E2M1, np.float64)[:, None] * np.exp2(scale.astype(np.float64) - 127)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    np.testing.assert_array_equal(np.signbit(got[8]), True)  # -0 stays -0


def _experts(seed, g, k, n):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (g, k // 2, n), dtype=np.uint8)
    scales = rng.integers(118, 124, (g, k // 32, n), dtype=np.uint8)
    return ref.MXFP4(jnp.asarray(codes), jnp.asarray(scales))


@pytest.mark.parametrize("experts, k, n, cfg", [
    ([3, 0, 3, 1], 256, 64, WgmmaPairConfig(splits=2, stages=2, interpret=True)),
    ([2], 128, 64, WgmmaPairConfig(splits=1, stages=2, interpret=True)),  # one step (the interpreter hangs on a
    # K off the 128-value step, whose last tile reads past K: on the GPU TMA fills those rows with zeros)
])
def test_interpreted_pairs_equal_the_fp32_product(experts, k, n, cfg):
    rhs = _experts(k + n, 4, k, n)
    x = jax.random.normal(jax.random.key(k), (len(experts), k), jnp.float32).astype(jnp.bfloat16)
    got = pair_gemv(x, rhs, jnp.asarray(experts, jnp.int32), config=cfg)
    w = np.asarray(ref.dequantize(rhs, jnp.float32), np.float64)[np.asarray(experts)]
    want = np.einsum("rk,rkn->rn", np.asarray(x, np.float64), w)
    assert got.shape == (len(experts), n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_lowers_for_hopper():
    x = jax.ShapeDtypeStruct((4, 2880), jnp.bfloat16)
    rhs = ref.MXFP4(jax.ShapeDtypeStruct((32, 1440, 5760), jnp.uint8), jax.ShapeDtypeStruct((32, 90, 5760), jnp.uint8))
    ex = jax.ShapeDtypeStruct((4,), jnp.int32)
    text = jax.jit(lambda x, r, e: pair_gemv(x, r, e)).trace(x, rhs, ex).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
