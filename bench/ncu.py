"""Attention kernels under Nsight Compute: every kernel of one call, timed at ncu's locked clock.

    python -m bench.ncu                      # D64 and D128, fwd and bwd, tessera / cuDNN / torch
    python -m bench.ncu --d 64 --direction fwd --impl tessera,cudnn
    python -m bench.ncu --window 128 --impl tessera,cudnn   # sliding window; Tessera with sinks

Each (head dim, direction, implementation) runs in its own process under
`ncu --profile-from-start off --section SpeedOfLight`; the process warms the call up, then runs it
once between `cudaProfilerStart` and `cudaProfilerStop`, so ncu sees exactly one call's kernels
(helper fusions, reductions and conversions included). ncu serialises kernels and locks the SM
clock (~1.4 GHz on an H100), so the figures compare kernels with each other, free of launch
gaps, clock boost and the timing method, not with wall-clock rates. Shapes are bench/suites/attention.py's:
B4 S4096, Hq 64 (D64) or 32 (D128), Hkv 8, causal, bf16. With `--window W` Tessera also applies
per-head sinks (cuDNN has none; torch SDPA has no window and is skipped).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys

IMPLS = ("tessera", "cudnn", "torch")
QUERY_HEADS = {64: 64, 128: 32}  # by head dim, as bench/suites/attention.py's shapes
_UNITS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
          "second": 1e3, "s": 1e3}
_KERNEL = re.compile(r"^  (\S.*?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\)")
_DURATION = re.compile(r"^\s+Duration\s+(\S+)\s+([\d.,]+)\s*$")


def parse_durations(text: str) -> list[tuple[str, float]]:
    """(kernel name, milliseconds) for each kernel of ncu's details page, in launch order."""
    out, name = [], None
    for line in text.splitlines():
        if m := _KERNEL.match(line):
            name = m.group(1)
        elif (m := _DURATION.match(line)) and name is not None:
            unit, value = m.group(1), float(m.group(2).replace(",", ""))
            if unit not in _UNITS:
                raise ValueError(f"ncu reported {name}'s duration in unknown unit {unit!r}")
            out.append((name, value * _UNITS[unit]))
            name = None
    return out


def _one_call(impl: str, d: int, direction: str, window: int | None) -> None:
    """Warm up one attention call, then run it once inside the profiler's start/stop window."""
    import jax
    import torch

    from bench.suites import attention as K

    q, k, v, ct, sinks = K._attention_inputs(4, 4096, QUERY_HEADS[d], 8, d)
    if impl == "torch":
        run = K.torch_sdpa_call(q, k, v, True, direction == "bwd")
        wait = lambda _: torch.cuda.synchronize()
    else:
        fn = K.attention_fns(True, window, sinks if window else None)[impl]
        if direction == "fwd":
            f = jax.jit(fn)
            run = lambda: f(q, k, v)
        else:  # the backward alone: its forward ran in _pullback
            pull, f = K._pullback(fn, q, k, v), jax.jit(K._backward)
            run = lambda: f(pull, ct)
        wait = jax.block_until_ready
    for _ in range(2):
        wait(run())
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    wait(run())
    torch.cuda.profiler.stop()


def profile(impl: str, d: int, direction: str, window: int | None = None) -> list[tuple[str, float]]:
    """(kernel, ms) of one call of `impl`, from ncu run on a child process."""
    cmd = ["ncu", "--profile-from-start", "off", "--target-processes", "all", "--section", "SpeedOfLight",
           "--print-units", "base", sys.executable, "-m", "bench.ncu", "--call", impl, str(d), direction,
           str(window or 0)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    kernels = parse_durations(res.stdout)
    if res.returncode or not kernels:
        tail = (res.stdout + res.stderr)[-1500:]
        raise RuntimeError(f"ncu on {impl} D{d} {direction} gave no kernels (exit {res.returncode}):\n{tail}")
    return kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", default="64,128", help="head dims, comma-separated")
    p.add_argument("--direction", default="fwd,bwd", help="fwd, bwd or both")
    p.add_argument("--impl", default=",".join(IMPLS), help=f"some of {', '.join(IMPLS)}")
    p.add_argument("--window", type=int, default=None, help="sliding window (keys), as (W-1, 0)")
    p.add_argument("--call", nargs=4, metavar=("IMPL", "D", "DIRECTION", "WINDOW"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.call:  # the child process ncu profiles
        _one_call(args.call[0], int(args.call[1]), args.call[2], int(args.call[3]) or None)
        return
    if shutil.which("ncu") is None:
        raise SystemExit("ncu (Nsight Compute) is not on PATH")
    from bench.timing import print_table, record
    from tessera.lower.kernels.flash_attention import attention_flops
    for d in (int(x) for x in args.d.split(",")):
        for direction in args.direction.split(","):
            # TFLOP/s at ncu's clock: only the ratios between rows mean anything
            flops = attention_flops(4, 4096, 4096, QUERY_HEADS[d], d, causal=True, window=args.window,
                                    backward=direction == "bwd")
            case = f"D{d} {direction}" + (f" w{args.window}" if args.window else "")
            for impl in args.impl.split(","):
                if args.window and impl == "torch":
                    continue
                try:
                    kernels = profile(impl, d, direction, args.window)
                except RuntimeError as e:
                    print(e, flush=True)
                    continue
                for name, ms in kernels:
                    print(f"  {case} {impl:<8} {ms * 1e3:10.1f} us  {name[:100]}", flush=True)
                record(case, f"{impl} ({len(kernels)} kernels)", lambda: sum(ms for _, ms in kernels), flops)
    print_table()


if __name__ == "__main__":
    main()
