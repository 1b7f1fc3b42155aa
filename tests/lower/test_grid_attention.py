"""Non-causal sequence models for grid tasks: attention without the causal mask, learned position vectors
(`pos_embed`, per position or per grid axis) and the 2-D rotary encoding (`rope = rotary2d(...)`), each held to
a plain jax.numpy reference written here; their mistakes are positioned errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import tessera
from tessera.diagnostics import TesseraError

MODEL = """
model grid(vocab: int = 10, rows: int = 3, cols: int = 4, d: int = 16, heads: int = 2, head_dim: int = 8,
           per_cell: bool = false, rope2d: bool = false) {
  forward(tokens: i32[batch, seq = rows * cols]) {
    x = embed(tokens, vocab, d)
    x = per_cell ? pos_embed(x) : pos_embed(x, grid = [row = rows, col = cols])
    x = x + attention(x, heads = heads, kv_heads = heads, head_dim = head_dim, causal = false,
                      rope = rope2d ? rotary2d(theta = 100.0, cols = cols) : none)
    return unembed(x, vocab)
  }
}
"""
ARGS = {"vocab": 10, "rows": 3, "cols": 4, "d": 16, "heads": 2, "head_dim": 8}


def _program(tmp_path, source: str = MODEL, **args):
    (tmp_path / "grid.tsl").write_text(source)
    spec = tmp_path / "grid.yaml"
    spec.write_text(yaml.safe_dump({"name": "grid", "model": {"file": "grid.tsl", "args": {**ARGS, **args}},
                                    "numerics": {"default": "fp32", "params": "fp32"},
                                    "task": {"kind": "train", "seq_len": 12}}))
    return tessera.compile(tessera.load(spec))


def _rotary2d(x, rows: int, cols: int, theta: float = 100.0):
    """x [B, S, H, D] turned pair by pair: pair j (of D/2) by angle coord * theta^(-2 (j mod D/4) / (D/2)), coord
    the cell's row for j < D/4, its column after (rotate-half pairing: element j with element j + D/2)."""
    b, s, h, d = x.shape
    out = np.array(x, np.float64)
    for p in range(s):
        r, c = divmod(p, cols)
        for j in range(d // 2):
            coord = r if j < d // 4 else c
            angle = coord * theta ** (-2.0 * (j % (d // 4)) / (d // 2))
            a, bb = x[:, p, :, j], x[:, p, :, j + d // 2]
            out[:, p, :, j] = a * np.cos(angle) - bb * np.sin(angle)
            out[:, p, :, j + d // 2] = bb * np.cos(angle) + a * np.sin(angle)
    return out


def _reference(params, tokens, *, rows: int, cols: int, per_cell: bool, rope2d: bool):
    """The model in numpy: token + position vectors, one non-causal attention (softmax over every key), logits."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = p["embed/table"][tokens]                                           # [B, S, E]
    if per_cell:
        x = x + p["pos_embed/table"]
    else:
        x = x + (p["pos_embed/row"][:, None, :] + p["pos_embed/col"][None, :, :]).reshape(rows * cols, -1)
    q, k, v = (np.einsum("bse,ehd->bshd", x, p[f"attention/{n}"]) for n in "qkv")
    if rope2d:
        q, k = _rotary2d(q, rows, cols), _rotary2d(k, rows, cols)
    s = np.einsum("bshd,bthd->bhst", q, k) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("bhst,bthd->bshd", w, v)
    x = x + np.einsum("bshd,hde->bse", o, p["attention/o"])
    return x @ p["unembed/weight"]


@pytest.mark.parametrize("per_cell, rope2d", [(False, False), (True, False), (False, True)])
def test_grid_models_match_plain_numpy(tmp_path, per_cell, rope2d):
    prog = _program(tmp_path, per_cell=per_cell, rope2d=rope2d)
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.standard_normal(np.shape(v)) * 0.5, jnp.float32) for k, v in prog.init(0).items()}
    tokens = rng.integers(0, 10, (2, 12)).astype(np.int32)
    got = np.asarray(prog.forward(params, tokens))
    want = _reference(params, tokens, rows=3, cols=4, per_cell=per_cell, rope2d=rope2d)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    later = tokens.copy()
    later[:, -1] = (later[:, -1] + 1) % 10  # the last cell changes what the first one sees: no causal mask
    assert np.abs(np.asarray(prog.forward(params, later))[:, 0] - got[:, 0]).max() > 1e-3


def test_grid_position_params_and_gradients(tmp_path):
    prog = _program(tmp_path)
    shapes = {k: tuple(np.shape(v)) for k, v in prog.init(0).items()}
    assert shapes["pos_embed/row"] == (3, 16) and shapes["pos_embed/col"] == (4, 16)
    tokens = jnp.asarray(np.arange(24).reshape(2, 12) % 10, jnp.int32)
    grads = jax.grad(lambda p: jnp.sum(jax.nn.log_softmax(prog.logits(p, tokens))[..., 3]))(prog.init(0))
    assert float(jnp.abs(grads["pos_embed/row"]).min()) > 0 and float(jnp.abs(grads["pos_embed/col"]).min()) > 0


@pytest.mark.parametrize("old, new, message, at", [
    ("grid = [row = rows, col = cols]", "grid = [row = rows, col = 5]", "has 15 cells, but `seq` has 12 positions",
     "pos_embed(x, grid"),
    ("grid = [row = rows, col = cols]", "grid = [embed = rows, col = cols]", "must have distinct names",
     "pos_embed(x, grid"),
    ("head_dim = head_dim, causal", "head_dim = 6, causal", "rotary2d needs a head_dim that is a multiple of 4",
     "attention("),
])
def test_grid_mistakes_are_positioned_errors(tmp_path, old, new, message, at):
    source = MODEL.replace(old, new)
    with pytest.raises(TesseraError) as exc:
        _program(tmp_path, source, rope2d=True)
    d = exc.value.diagnostics[0]
    assert message in d.message, d.message
    assert d.span.file.endswith("grid.tsl")
    line = source.splitlines()[d.span.line - 1]
    assert line[d.span.col - 1:].startswith(at), (line, d.span)
