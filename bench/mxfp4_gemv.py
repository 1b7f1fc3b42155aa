"""MXFP4 pairs at decode: the grouped kernel (`pair_dot` with an Mxfp4Config), `pair_dot`'s default and
the matrix-vector kernel's (`mxfp4_gemv.GemvConfig`) variants; correctness on the GPU, time per call, GB/s
and % of the copy bandwidth.

    python -m bench.mxfp4_gemv [--sweep-only] [--variants n512_w4,...] [--json PATH]

1. the inline-PTX conversions against their jnp routes for every code byte (bitwise);
2. every variant on fresh random inputs (R = 5 unsorted pairs with repeats, both shapes) against
   `reference.mxfp4.pair_dot` (max |err| / max |ref|);
3. copy bandwidth: `bench.timing.copy_bandwidth` (a 512 MiB copy's busy time, bytes read + written);
4. sweep: every variant at R = 4, G = 32, both shapes;
5. per-kernel breakdown of the grouped kernel and the best variant at R = 4;
6. table: the grouped kernel, the default and the best variant at R = 1, 4, 8, G = 32 and 128, both
   shapes.

Time per call: GPU busy time from a profile (`bench.trace.profile_us`) of one program running the call
over T routings back to back, every kernel of a call counted (the split-K sum too), the gaps between
kernels not (the decode step runs as a CUDA graph). Consecutive calls take disjoint experts and T calls
touch > 2x the L2 (60 MB), so the weights come from HBM. GB/s counts the R experts' codes and scales
once each.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp

from bench.experiments.mxfp4_gemv_mma import MmaConfig, installed
from tessera.lower.kernels import mxfp4_gemv as mg, mxfp4_matmul as mk
from tessera.lower.reference import mxfp4 as ref

SHAPES = {"gate_up": (2880, 5760), "down": (2880, 2880)}
L2_BYTES = 60e6


def _variants() -> dict:
    g = mg.GemvConfig
    # the grouped kernel with one row a run (pair_dot's default before the matrix-vector kernel; the same
    # config for every R <= 16 at K = 2880) and pair_config (None)
    out = {"grouped": mk.default_config(4, 2880, 2880, 4), "default": None}
    out["n1024_w4_pair"] = g(block_n=1024, num_warps=4, dequant="pair")  # the default below sm_89
    # the default with a multiply and an add for each product (as before `mxfp4_gemv.fma`)
    out["n1024_w4_unfused"] = g(block_n=1024, num_warps=4, fma=False)
    for programs in (264, 528, 660):  # the default is 396: 3 an SM of an H100 / H200
        out[f"n1024_w4_p{programs}"] = g(block_n=1024, num_warps=4, programs=programs)
    out["n1024_w4_a2"] = g(block_n=1024, num_warps=4, ahead=2)
    out["n1024_w8"] = g(block_n=1024, num_warps=8)
    out["n512_w4"] = g(block_n=512, num_warps=4)
    out["n2048_w8"] = g(block_n=2048, num_warps=8)
    # the tensor-core route (bench/experiments/mxfp4_gemv_mma.py: measured, not kept)
    for bn, w in ((128, 4), (256, 4), (512, 4), (512, 8)):
        out[f"n{bn}_w{w}_mma"] = MmaConfig(block_n=bn, num_warps=w)
        out[f"n{bn}_w{w}_mma_wf"] = MmaConfig(block_n=bn, num_warps=w, weights_first=True)
    return out


def _config(variant, r, k, n):
    return variant if variant is not None else mg.pair_config(r, k, n)  # "default"


def _inputs(key, r, k, n, g):
    k1, k2, k3 = jax.random.split(key, 3)
    lhs = jax.random.normal(k1, (r, k), jnp.float32).astype(jnp.bfloat16)
    codes = jax.random.randint(k2, (g, k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.randint(k3, (g, k // 32, n), 118, 124, jnp.int32).astype(jnp.uint8)
    return lhs, ref.MXFP4(codes, scales)


def check_ptx() -> bool:
    """The inline-PTX conversions against their jnp routes, every code byte, bitwise (on the GPU)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    codes = jnp.arange(256 * 16, dtype=jnp.int32).astype(jnp.uint8).reshape(64, 64)

    def body(c_ref, p_ref, lo_ref, hi_ref):
        p_ref[...] = mg.pair_halves(c_ref[...], ptx=True)
        lo_ref[...], hi_ref[...] = mg.nibbles_e4m3(c_ref[...], ptx=True)
    shapes = (jax.ShapeDtypeStruct((64, 64), jnp.int32),) + (jax.ShapeDtypeStruct((64, 64), jnp.float32),) * 2
    pair, lo, hi = pl.pallas_call(body, out_shape=shapes, compiler_params=pltriton.CompilerParams(num_warps=4))(codes)
    table = jnp.asarray(ref.E2M1, jnp.float32)
    c = codes.astype(jnp.int32)
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)
    ok_pair = bool(jnp.array_equal(pair, mg.pair_halves(codes, ptx=False)))
    ok_e4m3 = bool(jnp.array_equal(bits(lo), bits(table[c & 15] / mg.E4M3_SHIFT))
                   and jnp.array_equal(bits(hi), bits(table[c >> 4] / mg.E4M3_SHIFT)))
    print(f"PTX bitwise: pair {ok_pair}, e4m3 {ok_e4m3}", flush=True)
    return ok_pair and ok_e4m3


def check(variants: dict) -> dict:
    """max |got - want| / max |want| per variant and shape; R = 5 unsorted pairs with repeats."""
    errs = {}
    key = jax.random.key(int(time.time()))
    for name, v in variants.items():
        worst = [0.0, 0.0]
        for shape, (k, n) in SHAPES.items():
            key, sub, ek = jax.random.split(key, 3)
            lhs, rhs = _inputs(sub, 5, k, n, 8)
            ex = jax.random.randint(ek, (5,), 0, 8, jnp.int32).at[3].set(0).at[4].set(0)  # repeats
            cfg = _config(v, 5, k, n)
            got = jax.jit(lambda a, b, e: mk.pair_dot(a, b, e, preferred_element_type=jnp.float32, config=cfg))(
                lhs, rhs, ex)
            want = ref.pair_dot(lhs.astype(jnp.float32), rhs, ex, preferred_element_type=jnp.float32)
            bf = jax.jit(lambda a, b, e: mk.pair_dot(a, b, e, config=cfg))(lhs, rhs, ex)
            err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
            err_bf = float(jnp.abs(bf.astype(jnp.float32) - want).max() / jnp.abs(want).max())
            assert bf.dtype == jnp.bfloat16 and got.dtype == jnp.float32
            worst = [max(worst[0], err), max(worst[1], err_bf)]
            print(f"check {name:22s} {shape:8s} fp32 out {err:.2e}  bf16 out {err_bf:.2e}", flush=True)
        errs[name] = worst
    return errs


def time_variant(v, r, k, n, g, key, breakdown=False):
    """(GPU busy us per call, GB/s): every kernel of the call (the split-K sum included), from a profile."""
    from bench.trace import profile_us
    lhs, rhs = _inputs(key, r, k, n, g)
    per_call = r * (k // 2 * n + k // 32 * n)
    t = max(4, min(32, math.ceil(2 * L2_BYTES / per_call)))  # experts recur only after G / R calls
    routings = [jnp.asarray([(c * r + i) % g for i in range(r)], jnp.int32) for c in range(t)]
    cfg = _config(v, r, k, n)
    us, _ = profile_us(lambda a, b, e: mk.pair_dot(a, b, e, config=cfg), (lhs, rhs), routings, breakdown=breakdown)
    return us, per_call / us / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--variants", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
    variants = _variants()
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",") or k in ("grouped", "default")}
    result = {"device": dev.device_kind, "jax": jax.__version__}
    result["ptx_ok"] = check_ptx()
    result["errors"] = check(variants)
    from bench.timing import copy_bandwidth
    bw = copy_bandwidth()
    result["copy_gbs"] = bw
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    key = jax.random.key(1)
    sweep = {}
    for name, v in variants.items():
        for shape, (k, n) in SHAPES.items():
            us, gbs = time_variant(v, 4, k, n, 32, key)
            sweep[(name, shape)] = us
            print(f"sweep {name:22s} R4 G32 {shape:8s} {us:7.2f} us {gbs:6.0f} GB/s {100 * gbs / bw:5.1f} %",
                  flush=True)
    result["sweep"] = {f"{a}/{b}": t for (a, b), t in sweep.items()}
    ranked = sorted((n for n in variants if n != "grouped"),
                    key=lambda n: max(sweep[(n, s)] / sweep[("grouped", s)] for s in SHAPES))
    print("ranked (worst-shape time vs grouped):",
          ", ".join(f"{n} {max(sweep[(n, s)] / sweep[('grouped', s)] for s in SHAPES):.2f}" for n in ranked),
          flush=True)
    result["ranked"] = ranked
    if not args.sweep_only:
        for name in ["grouped", ranked[0]]:
            for shape, (k, n) in SHAPES.items():
                print(f"breakdown {name} {shape} R4 G32:", flush=True)
                time_variant(variants[name], 4, k, n, 32, key, breakdown=True)
        table = {}
        for name in ["grouped", "default"] + [n for n in ranked[:1] if n != "default"]:
            for shape, (k, n) in SHAPES.items():
                for g in (32, 128):
                    for r in (1, 4, 8):
                        us, gbs = time_variant(variants[name], r, k, n, g, key)
                        table[f"{name}/{shape}/G{g}/R{r}"] = (us, gbs)
                        print(f"table {name:22s} {shape:8s} G{g:<3d} R{r}: {us:7.2f} us {gbs:6.0f} GB/s "
                              f"{100 * gbs / bw:5.1f} % of copy", flush=True)
        result["table"] = table
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    with installed():  # the MmaConfig variants run the tensor-core route
        main()
