"""bench/experiments/wgmma_gemv.py on the CPU: interpreted, up to 8 tokens times a bf16 matrix equal the fp32 product
of the same values (K split into several programs, two consumer warpgroups a program); and the kernel passes Mosaic
GPU's lowering for Hopper (transposed shared-memory operands, the warp-specialized pipeline), which the interpreter
skips."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.experiments.wgmma_gemv import WgmmaGemvConfig, gemv, splits_for, supported


@pytest.mark.parametrize("b, k, n, cfg", [
    (1, 192, 128, WgmmaGemvConfig(splits=3, stages=2, interpret=True)),
    (5, 128, 256, WgmmaGemvConfig(block_n=256, splits=1, stages=2, interpret=True)),
])
def test_interpreted_product_equals_the_fp32_product(b, k, n, cfg):
    key = jax.random.key(k + b)
    x = jax.random.normal(key, (b, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(key, 1), (k, n), jnp.float32).astype(jnp.bfloat16)
    got = gemv(x, w, out_dtype=jnp.float32, config=cfg)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert got.shape == (b, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_splits_divide_the_steps_and_aim_at_the_program_count():
    cfg = WgmmaGemvConfig()
    assert splits_for(2880, 4096, cfg) == 9  # 45 steps of 64: 32 tiles x 9 = 288 programs, the nearest to 264
    assert splits_for(4096, 2880, WgmmaGemvConfig(block_n=64)) == 4  # 64 steps: 45 tiles x 4 = 180 (x 8 = 360)
    with pytest.raises(ValueError, match="divide"):
        splits_for(2880, 4096, WgmmaGemvConfig(splits=4))
    x = jax.ShapeDtypeStruct((9, 2880), jnp.bfloat16)
    assert not supported(x, jax.ShapeDtypeStruct((2880, 4096), jnp.bfloat16), cfg)  # more than 8 tokens


def test_lowers_for_hopper():
    x = jax.ShapeDtypeStruct((1, 2880), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2880, 4096), jnp.bfloat16)
    text = jax.jit(lambda x, w: gemv(x, w)).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
