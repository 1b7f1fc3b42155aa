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
