"""Shared fixtures: small argument sets for the shipped models."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
DATA = ROOT / "tests" / "data" / "ir"

GPT_OSS = dict(vocab=256, d_model=64, layers=4, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2, d_ff=32,
               window=8)
LLAMA = dict(vocab=256, d_model=64, layers=2, heads=4, kv_heads=2, head_dim=16, d_ff=128)
GRID = dict(vocab=10, rows=3, cols=3, d_model=16, heads=2, head_dim=8, d_ff=32)
SHIPPED = {
    "gpt_oss": ("gpt_oss.tsl", GPT_OSS),
    "llama": ("llama.tsl", LLAMA),
    "llama_tied": ("llama.tsl", {**LLAMA, "tie_embeddings": True}),
    "grid_transformer": ("grid_transformer.tsl", {**GRID, "layers": 2}),
    "hrm": ("hrm.tsl", {**GRID, "l_layers": 1, "h_layers": 1, "l_steps": 2, "cycles": 2}),
    # the training options' branches: pre-norm layers, module and input norms, every step's gradient
    "hrm_options": ("hrm.tsl", {**GRID, "l_layers": 1, "h_layers": 1, "l_steps": 2, "cycles": 2, "pre_norm": True,
                                "input_norm": True, "state_scale": 0.5, "one_step": False}),
}
POLICY = {"default": "bf16 @accum(fp32)", "params": "fp32",
          "rules": {"*/moe/experts/*": "mxfp4", "*/moe/experts/*_bias": "bf16"}}


@pytest.fixture(params=sorted(SHIPPED))
def shipped(request):
    """(name, model path, args) for each shipped model configuration."""
    file, args = SHIPPED[request.param]
    return request.param, MODELS / file, args
