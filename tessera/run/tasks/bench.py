"""The `bench` task: time compile, forward, train step and decode; tokens/s and model FLOP utilisation.

FLOPs per token come from the program (counted from the Graph IR), never from a formula here.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np

from tessera.run.context import RunContext
from tessera.run.manifest import params_checksum

# dense bf16 peak FLOP/s per device, by a substring of jax's device_kind (first match wins)
PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("B200", 2250e12), ("A100", 312e12), ("L4", 121e12))
PARTS = ("forward", "train", "decode")


def peak_flops(device=None) -> float | None:
    """The device's peak FLOP/s, or None when unknown (e.g. CPU)."""
    kind = (device or jax.devices()[0]).device_kind
    return next((peak for key, peak in PEAK_FLOPS if key in kind), None)


def _time(fn: Callable, warmup: int, iters: int) -> tuple[float, float]:
    """(seconds of the first call, which compiles; mean seconds per call after `warmup` more)."""
    t = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t
    for _ in range(warmup):
        jax.block_until_ready(fn())
    t = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(fn())
    return first, (time.perf_counter() - t) / max(iters, 1)


def _parts(what) -> tuple[str, ...]:
    if what in (None, "all"):
        return PARTS
    return tuple([what] if isinstance(what, str) else what)


def run(ctx: RunContext) -> int:
    """Benchmark the parts task.what names (forward, train, decode; default all) and record the results."""
    task, prog = ctx.exp.task, ctx.prog
    b, s = int(task.batch), int(task.seq_len)
    warmup, iters = int(task.warmup), max(int(task.iters), 1)
    vocab = int(ctx.exp.model.args["vocab"])
    rng = np.random.default_rng(int(task.seed))
    tokens = rng.integers(0, vocab, (b, s), dtype=np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "mask": np.ones((b, s), np.float32)}
    params = ctx.initial_params()
    flops, peak = prog.flops_per_token(), peak_flops()
    results: dict[str, dict] = {}

    def report(name: str, first: float, per_call: float, tokens_per_call: int, flops_key: str | None) -> None:
        tps = tokens_per_call / per_call
        rec = {"compile_s": first - per_call, "step_s": per_call, "tokens_per_s": tps}
        if flops_key is not None:
            rec["mfu"] = flops[flops_key] * tps / peak if peak else None
        results[name] = rec
        mfu = f", MFU {rec['mfu']:.1%}" if rec.get("mfu") else ""
        ctx.say(f"{name}: {tps:,.0f} tokens/s ({per_call * 1e3:.2f} ms/step, compile {rec['compile_s']:.2f} s{mfu})")

    parts = _parts(getattr(task, "what", None))
    if "forward" in parts:
        report("forward", *_time(lambda: prog.forward(params, tokens), warmup, iters), b * s, "forward")
    if "train" in parts:
        holder = [prog.init_train_state(params)]  # threaded through: a step may donate its input state

        def step():
            holder[0], m = prog.train_step(holder[0], batch)
            return m["loss"]

        report("train", *_time(step, warmup, iters), b * s, "train_step")
    if "decode" in parts:
        n = max(int(getattr(task, "decode_tokens", 0) or 0), 2)
        prefill = _time(lambda: prog.generate(params, tokens, max_new_tokens=1), warmup, iters)
        full = _time(lambda: prog.generate(params, tokens, max_new_tokens=n), warmup, iters)
        report("decode", full[0], max(full[1] - prefill[1], 1e-9), b * (n - 1), None)
    ctx.manifest.update(bench=results, flops_per_token=flops, peak_flops=peak, metrics=[],
                        params_checksum=params_checksum(params))
    return 0
