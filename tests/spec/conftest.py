"""Fixtures of the spec tests: a temporary directory holding a placeholder model file, and a valid spec."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "spec"

VALID = """\
name: t
model:
  file: model.tsl
  args: {vocab: 256, d_model: 64, layers: 2, heads: 8, kv_heads: 4, experts: 4, d_ff: 64}
mesh: {dp: 2, tp: 2}
parallel:
  rules: {batch: [dp, fsdp], heads: tp}
  remat: dots
numerics:
  default: bf16 @accum(fp32)
  rules:
    "*/moe/experts/*": mxfp4
task:
  kind: train
  steps: 10
  batch: 8
  optimizer: {name: adamw, lr: 1e-3}
  data: {kind: synthetic, task: copy}
checkpoint: {every: 5}
"""


@pytest.fixture
def spec_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with `model.tsl`, so that specs can say `file: model.tsl`."""
    shutil.copy(DATA / "model.tsl", tmp_path / "model.tsl")
    monkeypatch.chdir(tmp_path)
    return tmp_path
