"""The `generate` task: complete a batch of prompts and report prefill and decode speed."""

from __future__ import annotations

import hashlib
import time

import jax
import numpy as np

from tessera.diagnostics import RunError
from tessera.run.compiletime import compile_phases
from tessera.run.context import RunContext
from tessera.run.manifest import device_memory, params_checksum


def encode_prompts(prompts, tokenizer: str | None, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts (text via the byte tokenizer, or id lists) → (ids int32[B, P] right-padded, lengths int32[B])."""
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer != "bytes":
                raise RunError(f"prompt {i} is text but task.tokenizer is {tokenizer!r}; use `bytes` or token ids")
            p = list(p.encode("utf-8"))
        rows.append([int(t) for t in p])
    if not rows or not all(rows):
        raise RunError("every prompt needs at least one token")
    bad = [(i, t) for i, r in enumerate(rows) for t in r if not 0 <= t < vocab]
    if bad:
        raise RunError(f"prompt {bad[0][0]} has token id {bad[0][1]} outside the vocabulary of {vocab}")
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    return ids, np.asarray([len(r) for r in rows], np.int32)


def decode(tokens: list[int], tokenizer: str | None) -> str | None:
    """Token ids back to text with the byte tokenizer (None without a tokenizer)."""
    if tokenizer != "bytes":
        return None
    return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


def _timed(fn, repeats: int = 1):
    """(fn's last output, the fastest of `repeats` wall times in s): host jitter only adds time."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return out, best


def completions(out: np.ndarray, lengths: np.ndarray, width: int, stop_tokens) -> list[list[int]]:
    """New tokens per row, cut after the first stop token (kept)."""
    stops, result = set(int(t) for t in stop_tokens or ()), []
    for row in np.asarray(out)[:, width:]:
        new = []
        for t in row.tolist():
            new.append(t)
            if t in stops:
                break
        result.append(new)
    return result


def sampling_kwargs(task) -> dict:
    """The program's generate() keywords from task.sampling (top_k 0 and top_p 1 mean "off")."""
    s = task.sampling
    return dict(temperature=float(s.temperature), top_k=int(s.top_k) or None,
                top_p=float(s.top_p) if float(s.top_p) < 1.0 else None,
                stop_tokens=tuple(int(t) for t in task.stop_tokens or ()), seed=int(task.seed))


def generate_all(prog, params, ids: np.ndarray, lengths: np.ndarray, n: int, kw: dict,
                 capacity: int | None = None) -> list[np.ndarray]:
    """Generate for every prompt, one batch per prompt length; returns each row's prompt + new tokens.
    `capacity`: the program's most new tokens (one compiled program for every n up to it)."""
    rows: list[np.ndarray] = [None] * len(ids)  # type: ignore[list-item]
    for length in sorted(set(lengths.tolist())):
        idx = np.flatnonzero(lengths == length)
        out = np.asarray(prog.generate(params, ids[idx, :length], max_new_tokens=n, capacity=capacity, **kw))
        for j, i in enumerate(idx):
            rows[i] = out[j]
    return rows


def run(ctx: RunContext) -> int:
    """Generate, print completions and tokens/s, record them (and a digest of the output) in the manifest."""
    task, prog = ctx.exp.task, ctx.prog
    tokenizer = getattr(task, "tokenizer", None)
    ids, lengths = encode_prompts(task.prompts, tokenizer, prog.vocab)
    params, kw, n = ctx.initial_params(split_layers=True), sampling_kwargs(task), int(task.max_new_tokens)
    gen = lambda k: generate_all(prog, params, ids, lengths, k, kw, capacity=n)  # one program for both
    with compile_phases() as phases:
        _, first_s = _timed(lambda: gen(n))  # the first call compiles
    rows, full_s = _timed(lambda: gen(n), repeats=3)
    _, prefill_s = _timed(lambda: gen(1), repeats=3)  # the same program, one token: the first token's latency
    prompt_tokens = int(lengths.sum())
    speed = {"prefill_tokens_per_s": prompt_tokens / max(prefill_s, 1e-9),
             "decode_tokens_per_s": len(rows) * max(n - 1, 0) / max(full_s - prefill_s, 1e-9),
             "first_call_s": first_s, "compile_s": max(first_s - full_s, 0.0), "first_token_s": prefill_s,
             "compile_phases": phases}
    outputs = []
    for i, row in enumerate(rows):
        new = completions(row[None], lengths[i:i + 1], int(lengths[i]), kw["stop_tokens"])[0]
        outputs.append({"prompt": ids[i, :lengths[i]].tolist(), "tokens": new, "text": decode(new, tokenizer)})
        ctx.say(repr(outputs[-1]["text"]) if outputs[-1]["text"] is not None else str(new))
    ctx.say(f"prefill {speed['prefill_tokens_per_s']:,.1f} tokens/s, "
            f"decode {speed['decode_tokens_per_s']:,.1f} tokens/s, first token {prefill_s * 1e3:,.1f} ms; compile "
            f"{speed['compile_s']:.1f} s (tracing {phases['trace_s']:.1f}, lowering {phases['lower_s']:.1f}, "
            f"XLA {phases['backend_s']:.1f})")
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(r).tobytes() for r in rows)).hexdigest()
    ctx.manifest.update(outputs=outputs, speed=speed, metrics=[{"step": 0, "tokens_sha256": digest}],
                        params_checksum=params_checksum(params), device_memory=device_memory())
    return 0
