"""Where a kernel's cycles go, phase by phase, from Mosaic GPU's on-device profiler.

    python -m bench.profile attention [--d 64] [--window 128] [--batch 1] [--seq 2048] [--keep DIR]

Runs the flash attention forward under `tessera.lower.kernels._mgpu.profiling`: every warpgroup
records the clock at the entry and exit of each `jax.named_scope` of the kernel (for the forward:
`qk`, `softmax` (`softmax_half` on a half-width edge block), `wait_v`, `wait_turn`, `pv` per KV
step; `wait_q`, `wait_k`, `release_q`, `epilogue` per item). Prints, per phase, the cycles a
compute warpgroup spends in it, how often it runs and the spread of one run; then the cycles
between consecutive top-level phases (code outside any scope) and the span of a warpgroup. The
clock reads cost ~12 cycles each and keep the compiler from moving code across a scope's edges,
so compare phases with each other, not the profiled kernel's time with the unprofiled one's. A
compiled program writes the trace of its first call only. Keep the problem small (B1, a few
thousand rows): each warpgroup has `--space` entries of SMEM for its scopes.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import tempfile

import numpy as np


@dataclasses.dataclass
class Phase:
    cycles: float  # per warpgroup, summed over the call
    count: float  # runs per warpgroup
    percentiles: tuple[float, float, float]  # 5th, 50th, 95th of one run, cycles


@dataclasses.dataclass
class Summary:
    warpgroups: int
    span: float  # cycles from a warpgroup's first event to its last, mean
    phases: dict[str, Phase]
    gaps: dict[tuple[str, str], Phase]  # (phase before, phase after): cycles outside any scope


def summarize(events: list[dict], *, per_cta: int, roles: tuple[int, ...]) -> Summary:
    """Per-phase cycles of the warpgroups whose index within their CTA is in `roles`.

    `events` is a trace's "traceEvents": "B"/"E" events with "name", "tid" (1 + warpgroup index
    over the whole grid, `per_cta` warpgroups a CTA) and "ts" (start time in us plus the cycles
    since the warpgroup's first event / 1000: differences within one warpgroup are cycles / 1000).
    Nested scopes count in full; gaps are taken between top-level scopes only.
    """
    by_tid: dict[int, list[dict]] = collections.defaultdict(list)
    for e in events:
        if (e["tid"] - 1) % per_cta in roles:
            by_tid[e["tid"]].append(e)
    runs: dict[str, list[float]] = collections.defaultdict(list)
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    spans = []
    for trace in by_tid.values():
        stack: list[dict] = []
        last: tuple[str, float] | None = None
        for e in trace:
            if e["ph"] == "B":
                if not stack and last is not None:
                    gaps[(last[0], e["name"])].append((e["ts"] - last[1]) * 1e3)
                stack.append(e)
                continue
            begin = stack.pop()
            if begin["name"] != e["name"]:
                raise ValueError(f"scope {begin['name']!r} closed by {e['name']!r} (tid {e['tid']})")
            runs[e["name"]].append((e["ts"] - begin["ts"]) * 1e3)
            if not stack:
                last = (e["name"], e["ts"])
        spans.append((trace[-1]["ts"] - trace[0]["ts"]) * 1e3)
    n = len(by_tid)

    def phase(xs: list[float]) -> Phase:
        p5, p50, p95 = np.percentile(xs, [5, 50, 95])
        return Phase(sum(xs) / n, len(xs) / n, (float(p5), float(p50), float(p95)))
    order = sorted(runs, key=lambda k: -sum(runs[k]))
    return Summary(n, float(np.mean(spans)) if spans else 0.0, {k: phase(runs[k]) for k in order},
                   {k: phase(v) for k, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))})


def print_summary(s: Summary, title: str) -> None:
    print(f"{title}: {s.warpgroups} warpgroups, span {s.span:.0f} cycles each")
    print(f"  {'phase':<24}{'cycles/wg':>11}{'share':>7}{'runs/wg':>9}{'p5':>8}{'p50':>8}{'p95':>8}")
    rows = list(s.phases.items())
    rows += [(f"{a} -> {b}", p) for (a, b), p in list(s.gaps.items())[:8]]
    for name, p in rows:
        share = p.cycles / s.span if s.span else 0.0
        print(f"  {name:<24}{p.cycles:>11.0f}{share:>7.1%}{p.count:>9.1f}"
              + "".join(f"{x:>8.0f}" for x in p.percentiles))


def profile_attention(*, d: int, window: int | None, batch: int, seq: int, space: int,
                      keep: str | None) -> Summary:
    """One profiled call of the flash forward (GQA 8 KV heads, 64 query heads at D64, 32 at D128)."""
    import jax
    import jax.numpy as jnp
    from tessera.lower.kernels import _mgpu
    from tessera.lower.kernels.flash_attention import flash_attention
    from tessera.lower.kernels.flash_attention_fwd import _WGS

    hq = 64 if d == 64 else 32
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (batch, seq, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (batch, seq, 8, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (batch, seq, 8, d), jnp.bfloat16)
    sinks = jax.random.normal(ks[3], (hq,), jnp.float32) if window else None
    out = pathlib.Path(keep or tempfile.mkdtemp(prefix="tessera-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*-trace.json"))
    with _mgpu.profiling(str(out), space):
        fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, sinks=sinks, causal=True, window=window))
        # A compiled program names its trace file once, so only its first call's trace is written.
        jax.block_until_ready(fn(q, k, v))
    jax.effects_barrier()  # the trace is written by a host callback
    written = sorted(set(out.glob("*-trace.json")) - before, key=lambda f: f.stat().st_mtime)
    if not written:
        raise SystemExit(f"no trace was written to {out}")
    print(f"trace: {written[-1]} (open it in Perfetto)")
    events = json.loads(written[-1].read_text())["traceEvents"]
    # the kernel's compute warpgroups, then its one memory warpgroup
    return summarize(events, per_cta=_WGS + 1, roles=tuple(range(_WGS)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=["attention"])
    ap.add_argument("--d", type=int, default=64, choices=[64, 128])
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--space", type=int, default=512, help="scope entries per warpgroup and call")
    ap.add_argument("--keep", default=None, help="directory for the trace (default: a new temporary one)")
    a = ap.parse_args()
    s = profile_attention(d=a.d, window=a.window, batch=a.batch, seq=a.seq, space=a.space, keep=a.keep)
    title = f"flash fwd B{a.batch} S{a.seq} D{a.d} causal" + (f" window {a.window} + sinks" if a.window else "")
    print_summary(s, title + ", compute warpgroups")


if __name__ == "__main__":
    main()
