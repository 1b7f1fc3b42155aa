"""The `bench` task: time compile, forward, train step and decode; tokens/s and model FLOP utilisation.

FLOPs per token come from the program (counted from the Graph IR), never from a formula here.
Each phase is called once to compile, `warmup` more times untimed, then `iters` times timed; the
report gives the median and the spread (min, max) of those calls.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import numpy as np

from tessera.run.context import RunContext
from tessera.run.manifest import device_memory, params_checksum

PHASES = ("compile", "forward", "train_step", "decode")


def peak_flops() -> float | None:
    """This machine's accelerator's dense bf16 peak FLOP/s (the plan's device table), None when unknown."""
    from tessera.run.plan import pick_device

    return pick_device(None)[1].peak_flops


def time_calls(fn: Callable, warmup: int, iters: int) -> dict[str, float]:
    """Seconds of the first call (compiles) and the median / min / max of `iters` timed calls."""
    t = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(max(iters, 1)):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {"first_s": first, "compile_s": max(first - med, 0.0), "median_s": med, "min_s": min(times),
            "max_s": max(times)}


class Bench:
    """Times the phases of one program on random tokens [batch, seq_len]."""

    def __init__(self, ctx: RunContext, train: bool = False):
        """`train`: the train step will be timed. Its optimizer state is then made here, beside the parameters and
        before any phase runs, as a train task holds them: made after the forward's buffers came and went, the
        step's one large block of temporaries found no room in a card its peak fits (GPT-OSS-20B's two layers in
        deterministic mode, 60.5 GiB of 70.8, out of memory on one H100 when the forward ran first)."""
        task, self.prog, self.ctx = ctx.exp.task, ctx.prog, ctx
        self.b, self.s = int(task.batch), int(task.seq_len)
        self.warmup, self.iters = int(task.warmup), int(task.iters)
        self.decode_tokens = max(int(task.decode_tokens), 2)
        vocab = self.prog.vocab
        self.tokens = np.random.default_rng(int(task.seed)).integers(0, vocab, (self.b, self.s), dtype=np.int32)
        self.params = ctx.initial_params()
        self.state = self.prog.init_train_state(self.params) if train else None
        self.flops, self.peak = self.prog.flops_per_token(), peak_flops()

    def forward(self) -> dict:
        """Forward pass over [batch, seq_len] tokens."""
        t = time_calls(lambda: self.prog.forward(self.params, self.tokens), self.warmup, self.iters)
        return self._rate(t, self.b * self.s, t["median_s"], "forward")

    def train_step(self) -> dict:
        """One optimizer step (gradient accumulation included) over [batch, seq_len] tokens, from the state made with
        `train`."""
        batch = {"tokens": self.tokens, "targets": np.roll(self.tokens, -1, axis=1),
                 "mask": np.ones((self.b, self.s), np.float32)}
        holder, self.state = [self.state], None  # threaded through: a step may donate its input

        def step():
            holder[0], m = self.prog.train_step(holder[0], batch)
            return m["loss"]

        t = time_calls(step, self.warmup, self.iters)
        self.params = holder[0].params  # the step consumed the state it was given, whose params these were
        return self._rate(t, self.b * self.s, t["median_s"], "train_step")

    def decode(self) -> dict:
        """Decode tokens/s: (full generation - prefill-only generation) time per new token."""
        gen = lambda n: self.prog.generate(self.params, self.tokens, max_new_tokens=n, capacity=self.decode_tokens)
        prefill = time_calls(lambda: gen(1), self.warmup, self.iters)
        full = time_calls(lambda: gen(self.decode_tokens), self.warmup, self.iters)
        per_token_s = max(full["median_s"] - prefill["median_s"], 1e-9) / (self.decode_tokens - 1)
        rec = self._rate(full, self.b, per_token_s, None)
        rec["prefill_tokens_per_s"] = self.b * self.s / prefill["median_s"]
        return rec

    def _rate(self, t: dict, tokens: int, seconds: float, flops_key: str | None) -> dict:
        rec = {**t, "tokens_per_s": tokens / seconds}
        if flops_key is not None:
            rec["flops_per_token"] = self.flops[flops_key]
            rec["mfu"] = self.flops[flops_key] * rec["tokens_per_s"] / self.peak if self.peak else None
        return rec


def run(ctx: RunContext) -> int:
    """Benchmark the phases task.what names and record the results in the manifest."""
    what = list(getattr(ctx.exp.task, "what", None) or PHASES)
    phases = [p for p in ("forward", "train_step", "decode") if p in what or ("compile" in what and p != "decode")]
    bench = Bench(ctx, train="train_step" in phases)
    results = {}
    for phase in phases:
        results[phase] = r = getattr(bench, phase)()
        mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") else ""
        ctx.say(f"{phase}: {r['tokens_per_s']:,.0f} tokens/s (median {r['median_s'] * 1e3:.2f} ms, "
                f"spread {r['min_s'] * 1e3:.2f}-{r['max_s'] * 1e3:.2f} ms, compile {r['compile_s']:.2f} s{mfu})")
    if "compile" in what:
        results["compile"] = {p: r["compile_s"] for p, r in results.items()}
    ctx.manifest.update(bench=results, flops_per_token=bench.flops, peak_flops=bench.peak, metrics=[],
                        device_memory=device_memory(),
                        params_checksum=params_checksum(bench.params))
    return 0
