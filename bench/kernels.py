"""Times Tessera's GPU kernels against their peers on the same shapes in one run; prints one table.

    python -m bench.kernels [--only attention,moe,decode] [--check] [--head-dims 64] [--rounds 3]

Peers: XLA (jnp reference), cuDNN through jax.nn.dot_product_attention, PyTorch SDPA and
torch._grouped_mm, lax.ragged_dot, a padded batched einsum. TFLOP/s count only the work needed
(visible pairs for attention, real rows for grouped GEMM); decode reports GB/s against the
measured copy bandwidth. The ratio column is Tessera / best peer on the same row.

The harness is bench/timing.py, each group's cases a module of bench/suites/; `python -m bench.results`
runs the groups of bench/RESULTS.md and rewrites it.
"""

from __future__ import annotations

import argparse

from bench import timing
from bench.suites import attention, decode, fp8, moe, mxfp4, rms_norm

GROUPS = {"attention": attention.run_attention, "moe": moe.run_moe, "dense": moe.run_dense,
          "tune": attention.tune_attention, "decode": decode.run_decode, "mxfp4": mxfp4.run_mxfp4,
          "rmsnorm": rms_norm.run_rms_norm, "fp8": fp8.run_fp8, "tune_mxfp4": mxfp4.tune_mxfp4,
          "tune_decode": decode.tune_decode}


def main() -> None:
    """Run the selected groups and print the table."""
    import jax

    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="attention,moe,decode,dense",
                    help=f"groups, comma-separated: {', '.join(GROUPS)}")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--timing", choices=["program", "dispatch"], default="program",
                    help="JAX rows: calls inside one program (default) or one program per call")
    ap.add_argument("--head-dims", default="64,128", help="attention rows: head dims 64 and/or 128")
    ap.add_argument("--rounds", type=int, default=timing.ROUNDS,
                    help="tune and tune_decode: time each variant this many times, in turns, and keep the median")
    opts = ap.parse_args()
    if opts.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {opts.rounds}")
    timing.TIMING, timing.ROUNDS = opts.timing, opts.rounds
    attention.HEAD_DIMS = tuple(int(d) for d in opts.head_dims.split(","))
    if not set(attention.HEAD_DIMS) <= set(attention.ATTENTION_SHAPES):
        ap.error(f"--head-dims takes {sorted(attention.ATTENTION_SHAPES)}, got {opts.head_dims}")
    print(f"devices: {jax.devices()}  jax {jax.__version__}  timing: {timing.TIMING}")
    for name in opts.only.split(","):
        if name in GROUPS:
            GROUPS[name](check=opts.check)
    timing.print_table()


if __name__ == "__main__":
    main()
