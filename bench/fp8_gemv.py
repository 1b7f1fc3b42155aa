"""Block-scaled fp8 weights times one token (batch-1 decode): the Pallas kernel (`kernels.fp8_gemv`) and its
variants against XLA's bf16 product of the same weights held in bf16 and against the reference's fused
multiply-reduce (`reference.fp8_blocks.weight_only_einsum`), on GPT-OSS-20B's attention projections.

    python -m bench.fp8_gemv [--variants NAME,...]

Each case is 24 distinct weights (the 20b's layers; > 2x the L2, so they come from HBM), one call each in one
program; time per call is GPU busy time from a profile (`bench.trace.profile_us`), every kernel of the call
counted (the split-K sum too). GB/s counts the bytes held (codes + scales; bf16: two a weight). Each variant is
first checked against the exact product of the dequantised weights (max |err| / max |exact|).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from tessera.lower.kernels import fp8_gemv as fg
from tessera.lower.reference import fp8_blocks as fb

LAYERS = 24
# name: (einsum, x shape, W shape, block): GPT-OSS-20B's q, k (v alike) and o as the fp8-attention row holds them
CASES = {"q": ("btd,dhk->bthk", (1, 1, 2880), (2880, 64, 64), 64),
         "k": ("btd,dhk->bthk", (1, 1, 2880), (2880, 8, 64), 8),
         "o": ("bthk,hkd->btd", (1, 1, 64, 64), (64, 64, 2880), 64)}


def _variants() -> dict:
    c = fg.Fp8GemvConfig
    out = {"default": c()}
    for bn, w in ((256, 2), (512, 2), (512, 4), (2048, 8)):
        out[f"n{bn}_w{w}"] = c(block_n=bn, num_warps=w)
    for r in (4, 16):
        out[f"r{r}"] = c(rows=r)
    out["a2"] = c(ahead=2)
    out["p1056"] = c(programs=1056)
    out["p264"] = c(programs=264)
    # fewer, longer programs and fewer fp32 partials
    out["n128_w1"] = c(block_n=128, num_warps=1)
    out["n256_w1"] = c(block_n=256, num_warps=1)
    out["n1024_w4_r16_p264"] = c(rows=16, programs=264)
    out["n1024_w8"] = c(num_warps=8)
    out["n4096_w16"] = c(block_n=4096, num_warps=16)
    return out


def _weights(case: str, key):
    spec, xs, ws, block = CASES[case]
    kx, *kw = jax.random.split(key, LAYERS + 1)
    x = jax.random.normal(kx, xs, jnp.float32).astype(jnp.bfloat16)
    quant = jax.jit(lambda k: fb.quantize(jax.random.normal(k, ws, jnp.float32), block))
    return spec, x, [quant(k) for k in kw]


def main():
    from bench.timing import copy_bandwidth
    from bench.trace import profile_us

    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="")
    ap.add_argument("--breakdown", action="store_true", help="print each call's kernels (the default variant)")
    args = ap.parse_args()
    variants = _variants()
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    dev = jax.devices()[0]
    bw = copy_bandwidth()
    print(f"# {dev.device_kind}, jax {jax.__version__}, copy bandwidth {bw:,.0f} GB/s", flush=True)
    for case in CASES:
        spec, x, ws = _weights(case, jax.random.key(len(case)))
        held = ws[0].nbytes
        bf16 = [fb.dequantize(w, jnp.bfloat16) for w in ws]
        exact = jnp.einsum(spec, x.astype(jnp.float32), fb.dequantize(ws[0], jnp.float32), precision="highest")
        rows = []

        def timed(name, fn, weights, nbytes):
            us, _ = profile_us(fn, (x,), weights, breakdown=args.breakdown and name.startswith("fp8_gemv default"))
            rows.append((name, us, nbytes / us / 1e3))

        timed("xla bf16 weights", lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
              .astype(jnp.bfloat16), bf16, 2 * ws[0].codes.size)
        timed("reference reduction", lambda x, w: fb.weight_only_einsum(
            spec, x, w, compute_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16), ws, held)
        for name, cfg in variants.items():
            ok = fg.supported(spec, x, ws[0], config=cfg)
            if ok is not True:
                print(f"{case} {name}: not taken ({ok})", flush=True)
                continue
            fn = lambda x, w, cfg=cfg: fg.weight_only_einsum(spec, x, w, out_dtype=jnp.bfloat16, config=cfg)
            got = jax.jit(lambda x, w, cfg=cfg: fg.weight_only_einsum(spec, x, w, out_dtype=jnp.float32,
                                                                    config=cfg))(x, ws[0])
            err = float(jnp.abs(got - exact).max() / jnp.abs(exact).max())
            timed(f"fp8_gemv {name} (err {err:.1e})", fn, ws, held)
        base = rows[0][1]
        print(f"\n{case}: {spec}, W {list(ws[0].shape)} per_block({fb.FP8Blocks.block.fget(ws[0])}), "
              f"{held / 1e6:.2f} MB held", flush=True)
        for name, us, gbs in rows:
            print(f"  {name:40s} {us:8.1f} us  {gbs:7.0f} GB/s  {100 * gbs / bw:4.0f}% of copy  "
                  f"{base / us:5.2f}x bf16", flush=True)


if __name__ == "__main__":
    main()
