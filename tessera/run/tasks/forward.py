"""The `forward` task: logits for given tokens, written to `logits.npy` in the run directory."""

from __future__ import annotations

import hashlib

import numpy as np

from tessera.diagnostics import RunError
from tessera.run.context import RunContext
from tessera.run.data import open_tokens
from tessera.run.manifest import params_checksum


def _tokens(ctx: RunContext) -> np.ndarray:
    """task.tokens ([[ids]] or [ids]) or task.tokens_file (.npy/.bin) as int32[B, S]."""
    task = ctx.exp.task
    if getattr(task, "tokens", None) is not None:
        arr = np.asarray(task.tokens)
    elif getattr(task, "tokens_file", None):
        path = ctx.resolve(task.tokens_file, ctx.spec_dir or ctx.run_dir)
        arr = np.load(path) if path.suffix == ".npy" and path.is_file() else open_tokens(path)
    else:
        raise RunError("forward task needs task.tokens or task.tokens_file")
    arr = np.asarray(arr)
    if arr.ndim == 1:
        arr = arr[None, :]
    vocab = ctx.prog.vocab
    if arr.ndim != 2 or arr.dtype.kind not in "iu" or arr.size == 0:
        raise RunError(f"forward tokens must be a non-empty [batch, seq] integer array, "
                       f"got {arr.dtype}{list(arr.shape)}")
    if int(arr.max()) >= vocab or int(arr.min()) < 0:
        raise RunError(f"forward tokens hold id {int(arr.max())} outside the vocabulary of {vocab}")
    return arr.astype(np.int32)


def run(ctx: RunContext) -> int:
    """Run the forward pass once and save the logits [B, S, V]."""
    tokens = _tokens(ctx)
    params = ctx.initial_params()
    logits = np.asarray(ctx.prog.forward(params, tokens))
    out = ctx.resolve(getattr(ctx.exp.task, "out", None) or "logits.npy")
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, logits)
    digest = hashlib.sha256(np.ascontiguousarray(logits).tobytes()).hexdigest()
    ctx.say(f"logits {logits.dtype}{list(logits.shape)} -> {out}")
    ctx.manifest.update(metrics=[{"step": 0, "logits_sha256": digest}], params_checksum=params_checksum(params),
                        outputs={"logits": str(out), "shape": list(logits.shape)})
    return 0
