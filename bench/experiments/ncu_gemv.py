"""The MXFP4 matrix-vector kernel (`mxfp4_gemv`, pair_dot's default) under Nsight Compute: where one call's
time goes (issue slots, stall reasons, instruction mix, memory throughput, SASS).

    python -m bench.experiments.ncu_gemv [--r 4] [--n 5760] [--out DIR] [--warps 4] [--block-n 1024]

One child process warms the call up and runs it once between cudaProfilerStart and cudaProfilerStop;
ncu profiles that call with the detail sections, then once more for the kernel's SASS with per-instruction
counters. Both reports are written under --out (details.txt, source.txt).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats", "InstructionStats",
            "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis")


def _one_call(r: int, k: int, n: int, warps: int, block_n: int) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    from bench.mxfp4_gemv import _inputs
    from tessera.lower.kernels import mxfp4_gemv as mg, mxfp4_matmul as mk

    lhs, rhs = _inputs(jax.random.key(0), r, k, n, 32)
    ex = jnp.arange(r, dtype=jnp.int32) * 3
    cfg = mg.GemvConfig(block_n=block_n, num_warps=warps)
    f = jax.jit(lambda a, b, e: mk.pair_dot(a, b, e, config=cfg))
    for _ in range(3):
        jax.block_until_ready(f(lhs, rhs, ex))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    jax.block_until_ready(f(lhs, rhs, ex))
    torch.cuda.profiler.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--r", type=int, default=4)
    p.add_argument("--k", type=int, default=2880)
    p.add_argument("--n", type=int, default=5760)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--block-n", type=int, default=1024)
    p.add_argument("--out", default=".")
    p.add_argument("--call", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.call:
        _one_call(a.r, a.k, a.n, a.warps, a.block_n)
        return
    child = [sys.executable, "-m", "bench.experiments.ncu_gemv", "--call", "--r", str(a.r), "--k", str(a.k),
             "--n", str(a.n), "--warps", str(a.warps), "--block-n", str(a.block_n)]
    base = ["ncu", "--profile-from-start", "off", "--target-processes", "all", "-k", "regex:mxfp4"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {"details.txt": base + [x for s in SECTIONS for x in ("--section", s)] + ["--print-details", "all"],
            "source.txt": base + ["--section", "SourceCounters", "--page", "source", "--print-source", "sass"]}
    for name, cmd in runs.items():
        res = subprocess.run(cmd + child, capture_output=True, text=True)
        (out / name).write_text(res.stdout + "\n--- stderr ---\n" + res.stderr)
        print(f"{name}: exit {res.returncode}, {len(res.stdout.splitlines())} lines", flush=True)


if __name__ == "__main__":
    main()
