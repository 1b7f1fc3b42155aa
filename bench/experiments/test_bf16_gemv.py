"""bench/experiments/bf16_gemv.py interpreted on the CPU: one token times one or several bf16 matrices in one launch
equals the fp32 product of the same values (fp32 sums, K split into several programs, ragged N tiles)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.experiments.bf16_gemv import GemvConfig, gemv


@pytest.mark.parametrize("k, ns, cfg", [
    (96, [64], GemvConfig(block_n=32, rows=8, splits=3, interpret=True)),
    (100, [80, 16, 16], GemvConfig(block_n=32, rows=4, splits=2, ahead=2, interpret=True)),  # K % rows, N % block
])
def test_one_launch_equals_each_product(k, ns, cfg):
    key = jax.random.key(k)
    x = jax.random.normal(key, (k,), jnp.float32).astype(jnp.bfloat16)
    ws = [jax.random.normal(jax.random.fold_in(key, i + 1), (k, n), jnp.float32).astype(jnp.bfloat16)
          for i, n in enumerate(ns)]
    got = gemv(x, ws, out_dtype=jnp.float32, config=cfg)
    for g, w in zip(got, ws):
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        assert g.shape == (w.shape[1],)
        np.testing.assert_allclose(np.asarray(g), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
