"""Fused RMSNorm (+ residual) kernel vs reference/norms.rms_norm: outputs and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from bench.experiments.rms_norm import (RmsNormConfig, add_rms_norm, add_rms_norm_reference, rms_norm,
                                            supported)
from tessera.lower.reference.norms import rms_norm as rms_norm_reference
from tests.lower.kernels._check import assert_close

up = lambda a: a.astype(jnp.float32)


def _inputs(seed, shape, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], shape, dtype)
    r = jax.random.normal(ks[1], shape, dtype)
    scale = 1.0 + 0.1 * jax.random.normal(ks[2], shape[-1:], jnp.float32)
    return x, r, scale, jax.random.normal(ks[3], shape), jax.random.normal(ks[4], shape)


def _check_residual(shape, cfg, tol=1e-2):
    """y, h and d x, d r, d scale of <y, cy> + <h, ch> against the reference on upcast inputs."""
    x, r, scale, cy, ch = _inputs(sum(shape), shape)
    y, h = jax.jit(lambda x, r, s: add_rms_norm(x, r, s, eps=1e-5, config=cfg))(x, r, scale)
    yr, hr = jax.jit(lambda x, r, s: add_rms_norm_reference(x, r, s, eps=1e-5))(x, r, scale)
    assert y.dtype == x.dtype and h.dtype == x.dtype
    assert_close(h, hr, 1e-6, "h")  # the same bf16 rounding of x + r
    assert_close(y, yr, tol, "y")

    def loss(f):
        def run(x, r, s):
            y, h = f(x, r, s)
            return jnp.vdot(up(y), cy) + jnp.vdot(up(h), ch)
        return jax.grad(run, argnums=(0, 1, 2))

    got = jax.jit(loss(lambda x, r, s: add_rms_norm(x, r, s, eps=1e-5, config=cfg)))(x, r, scale)
    want = jax.jit(loss(lambda x, r, s: add_rms_norm_reference(x, r, s, eps=1e-5)))(up(x), up(r), scale)
    for name, a, b in zip(("dx", "dr", "dscale"), got, want):
        assert_close(a, b, tol, name)


def _check_plain(shape, cfg, tol=1e-2):
    """rms_norm alone: y, d x and d scale."""
    x, _, scale, cy, _ = _inputs(sum(shape) + 1, shape)
    y = jax.jit(lambda x, s: rms_norm(x, s, eps=1e-6, config=cfg))(x, scale)
    assert_close(y, jax.jit(lambda x, s: rms_norm_reference(x, scale=s, eps=1e-6))(up(x), scale), tol, "y")
    grad = lambda f: jax.grad(lambda x, s: jnp.vdot(up(f(x, s)), cy), argnums=(0, 1))
    got = jax.jit(grad(lambda x, s: rms_norm(x, s, eps=1e-6, config=cfg)))(x, scale)
    want = jax.jit(grad(lambda x, s: rms_norm_reference(x, scale=s, eps=1e-6)))(up(x), scale)
    for name, a, b in zip(("dx", "dscale"), got, want):
        assert_close(a, b, tol, name)


def test_interpret_residual():
    """Interpreter: D not a power of two, rows not a multiple of block_r, leading batch dims."""
    _check_residual((3, 3, 200), RmsNormConfig(block_r=2, interpret=True))


def test_interpret_plain():
    """Interpreter: 1100 rows, so each backward program walks two row blocks (d scale partials)."""
    _check_plain((1100, 48), RmsNormConfig(block_r=2, interpret=True))


def test_supported_reasons():
    """No GPU: not supported; on the interpreter the reason is the measurement (XLA is as fast)."""
    x, r, scale, _, _ = _inputs(0, (4, 64))
    ok, why = supported(x, scale, r)
    assert not ok and why == "no GPU backend"
    ok, why = supported(x, scale[:32], r, RmsNormConfig(interpret=True))
    assert not ok and "scale" in why
    with pytest.raises(ValueError, match="power of two"):
        RmsNormConfig(block_r=3)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2880), (3, 1000, 4096), (17, 2880)])
def test_gpu_residual_and_plain(shape):
    """On a GPU: GPT-OSS widths, rows off the block."""
    _check_residual(shape, RmsNormConfig())
    _check_plain(shape, RmsNormConfig(block_r=2))
