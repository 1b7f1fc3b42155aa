"""Shared helpers for the lowering tests: the committed Hugging Face fixtures and float64 mode."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

HF_DATA = Path(__file__).resolve().parents[1] / "data" / "hf"
# the GPU tests' model: the tiny GPT-OSS at kernel-sized heads (D 64, GQA 8/2), window 128, bf16, 4 x 512 tokens;
# fast (not deterministic) mode, whose loss jax.grad differentiates from outside
GPT_OSS_TINY = Path(__file__).resolve().parents[2] / "specs" / "gpt_oss_tiny.yaml"
GPU_BF16 = {"model.args.head_dim": 64, "model.args.heads": 8, "model.args.kv_heads": 2, "model.args.window": 128,
            "numerics.default": "bf16 @accum(fp32)", "task.sample": None, "task.batch": 4, "task.seq_len": 512,
            "parallel.deterministic": False}


def hf_fixture(name: str) -> dict:
    """A fixture directory's metadata, config.json, tokens, logits and generated tokens."""
    d = HF_DATA / name
    return {
        "dir": d,
        "meta": json.loads((d / "fixture.json").read_text()),
        "config": json.loads((d / "config.json").read_text()),
        "tokens": np.load(d / "tokens.npy"),
        "logits": np.load(d / "logits.npy"),
        "generated": np.load(d / "generated.npy"),
    }


@pytest.fixture(scope="session")
def gpt_oss_pieces() -> dict[str, np.ndarray]:
    """Activations captured inside HF's GPT-OSS (see scripts/make_hf_fixtures.py)."""
    return load_file(HF_DATA / "gpt_oss" / "pieces.safetensors")


@pytest.fixture(scope="session")
def gpt_oss_params():
    """The GPT-OSS fixture's weights through the loader."""
    from tessera.lower.weights import load_hf_weights
    fx = hf_fixture("gpt_oss")
    return load_hf_weights(fx["dir"], family="gpt_oss", args=fx["meta"]["args"])


@contextlib.contextmanager
def float64():
    """Enable float64 inside the block only (finite-difference gradient checks), then restore."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def directional_grad_check(f, args, *, eps: float = 1e-6, rtol: float = 1e-6, seed: int = 0) -> None:
    """jax.grad of <f(args), ct> along a random direction vs central finite differences (call in float64())."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    out = jax.eval_shape(f, *args)
    ct = jnp.asarray(rng.standard_normal(out.shape), out.dtype)
    scalar = jax.jit(lambda *a: jnp.vdot(f(*a), ct))
    grads = jax.jit(jax.grad(scalar, argnums=tuple(range(len(args)))))(*args)
    dirs = [jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in args]
    analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(grads, dirs))
    plus = scalar(*(a + eps * d for a, d in zip(args, dirs)))
    minus = scalar(*(a - eps * d for a, d in zip(args, dirs)))
    numeric = float(plus - minus) / (2 * eps)
    assert abs(analytic - numeric) <= rtol * max(1.0, abs(numeric)), (analytic, numeric)
