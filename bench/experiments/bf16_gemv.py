"""One token times bf16 weights (batch-1 decode's attention projections) on the FMA units, Pallas Triton: against
XLA's product of the same weights, and q, k and v in one launch.

Why (issue 32, batch-1 decode at >= 60 % of the roofline): the 20b's decode step spends per layer 11.3 us on q
(cuBLAS nvjet, 2.1 TB/s), 10.5 us on o (2.25 TB/s) and 4.5 us on k and v, which XLA computes as one column-reduction
fusion at 1.3 TB/s (session 34's profile, one H100: docs/kernels-log.md). q, k and v read the same token: one launch
streaming the three weights would remove a launch and the slow reduction. The kernel is fp8_gemv's (one program per
(block_n columns, K split), `rows` weight rows a step loaded `ahead` steps early, fp32 sums; the split-K partials
summed in a fixed order outside), reading bf16 weights; `fused` takes several matrices of one K, their N tiles one
after another in the grid.

    python -m bench.experiments.bf16_gemv [--variants NAME,...]   (GPU; each case over 24 distinct weights, GPU
                                                                   busy time a call from a profile)
    python -m pytest bench/experiments/test_bf16_gemv.py          (CPU, interpreted)

Measured (session 35, one H100, jax 0.11.2): q|k|v in one launch 16.70 us a call (1.77 TB/s, 58 % of the copy
bandwidth; the other configurations 17.4-19.3), o 11.56 us (2.04 TB/s; XLA's einsum here 12.72). In the decode
program XLA takes 11.3 us for q (cuBLAS) and 4.5 for k and v (one reduce fusion): 15.8 us against the fused launch's
16.7, so the fused kernel is not wired in; o would save ~1 us a layer at best (not wired either: within the
call-to-call spread of the whole program). docs/kernels-log.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tessera.lower.kernels._vma import common, out_struct
from tessera.lower.kernels.fp8_gemv import Fp8GemvConfig
from tessera.lower.kernels.mxfp4_matmul import _steps


@dataclasses.dataclass(frozen=True)
class GemvConfig(Fp8GemvConfig):
    """fp8_gemv's configuration (one program per (block_n columns, K split), `rows` weight rows a step, loads
    `ahead` steps early; splits=0: enough K splits for about `programs` programs), 512 columns a program."""
    block_n: int = 512


def _kernel(x_ref, *refs, cfg: GemvConfig, k: int, ns: tuple[int, ...], tiles: tuple[int, ...], per: int):
    """Program (t, s): the matrix whose N tiles hold t, its columns' sums over split s's rows into out."""
    *w_refs, out_ref = refs
    t, s = pl.program_id(0), pl.program_id(1)
    bn, rows, total = cfg.block_n, cfg.rows, sum(ns)
    lo = s * per
    hi = jnp.minimum(lo + per, -(-k // rows))
    first_tile, offset = 0, 0
    for w_ref, n, nt in zip(w_refs, ns, tiles):
        @pl.when((t >= first_tile) & (t < first_tile + nt))
        def _(w_ref=w_ref, n=n, first_tile=first_tile, offset=offset):
            c = (t - first_tile) * bn + jnp.arange(bn, dtype=jnp.int32)
            col_ok = c < n

            def load(kk, live):
                ws, xs = [], []
                for i in range(rows):
                    j = kk * rows + i
                    ok = live & (j < k)
                    ws.append(pltriton.load(w_ref.at[jnp.minimum(j, k - 1) * n + c], mask=col_ok & ok, other=0))
                    xs.append(jnp.where(ok, x_ref[jnp.minimum(j, k - 1)].astype(jnp.float32), 0.0))
                return tuple(ws), tuple(xs)

            def step(tile, acc):
                ws, xs = tile
                for i in range(rows):
                    acc = acc + xs[i] * ws[i].astype(jnp.float32)
                return acc

            acc = _steps(load, step, lo, hi, jnp.zeros((bn,), jnp.float32), ahead=cfg.ahead)
            pltriton.store(out_ref.at[s * total + offset + c], acc, mask=col_ok)
        first_tile, offset = first_tile + nt, offset + n


def gemv(x, weights, *, out_dtype=jnp.bfloat16, config: GemvConfig | None = None):
    """x [K] times each of `weights` ([K, N_i], bf16) in one launch: the products [N_i] in out_dtype (fp32 sums,
    the split-K partials summed in a fixed order, then cast)."""
    cfg = config or GemvConfig()
    k = x.shape[0]
    ns = tuple(int(w.shape[1]) for w in weights)
    tiles = tuple(-(-n // cfg.block_n) for n in ns)
    steps = -(-k // cfg.rows)
    want = cfg.splits or -(-cfg.programs // sum(tiles))
    per = -(-steps // max(1, min(want, steps)))
    splits = -(-steps // per)
    flat = [w.reshape(-1) for w in weights]
    x, *flat = common(x, *flat)
    out = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, k=k, ns=ns, tiles=tiles, per=per),
        out_shape=out_struct((splits * sum(ns),), jnp.float32, flat[0]),
        grid=(sum(tiles), splits),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="bf16_gemv",
    )(x, *flat)
    y = lax.optimization_barrier(out.reshape(splits, sum(ns)).sum(axis=0).astype(out_dtype))
    bounds = [0]
    for n in ns:
        bounds.append(bounds[-1] + n)
    return [y[a:b] for a, b in zip(bounds, bounds[1:])]


# GPT-OSS-20B's attention projections at one token, as 2-D views: (K, [N of each matrix in one launch])
CASES = {"q": (2880, [4096]), "k": (2880, [512]), "o": (4096, [2880]), "q|k|v": (2880, [4096, 512, 512])}
LAYERS = 24


def _variants() -> dict:
    c = GemvConfig
    out = {"default": c()}
    for bn, w in ((256, 2), (1024, 4), (1024, 8), (2048, 8)):
        out[f"n{bn}_w{w}"] = c(block_n=bn, num_warps=w)
    for r in (4, 16):
        out[f"r{r}"] = c(rows=r)
    out["a2"] = c(ahead=2)
    out["p264"] = c(programs=264)
    out["p1056"] = c(programs=1056)
    return out


def main():
    from bench.timing import copy_bandwidth
    from bench.trace import profile_us

    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="")
    args = ap.parse_args()
    variants = _variants()
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    dev = jax.devices()[0]
    bw = copy_bandwidth()
    print(f"# {dev.device_kind}, jax {jax.__version__}, copy bandwidth {bw:,.0f} GB/s", flush=True)
    f32 = dict(preferred_element_type=jnp.float32)
    for case, (k, ns) in CASES.items():
        key = jax.random.key(k + sum(ns))
        kx, *kw = jax.random.split(key, LAYERS + 1)
        x = jax.random.normal(kx, (k,), jnp.float32).astype(jnp.bfloat16)
        sets = [[jax.random.normal(jax.random.fold_in(kk, i), (k, n), jnp.float32).astype(jnp.bfloat16)
                 for i, n in enumerate(ns)] for kk in kw]
        nbytes = 2 * k * sum(ns)
        exact = [jnp.einsum("k,kn->n", x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
                 for w in sets[0]]
        rows = []

        def timed(name, fn):
            us, _ = profile_us(fn, (x,), sets)
            got = fn(x, sets[0])
            err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - e)) / jnp.max(jnp.abs(e)))
                      for g, e in zip(got, exact))
            rows.append((name, us, nbytes / us / 1e3, err))

        # XLA: each product as the program writes it (bf16 result of an fp32 accumulation), one op a matrix
        timed("XLA einsum (one a matrix)", lambda x, ws: [jnp.einsum("k,kn->n", x, w, **f32).astype(jnp.bfloat16)
                                                          for w in ws])
        for name, cfg in variants.items():
            try:
                timed(f"bf16_gemv {name}", lambda x, ws, cfg=cfg: gemv(x, ws, config=cfg))
            except Exception as exc:  # a variant the compiler refuses: said, the others go on
                print(f"  {case} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        print(f"\n## {case}: K {k}, N {ns} ({nbytes / 1e6:.1f} MB a call)")
        print("| variant | us a call | GB/s | % of copy | max err / max |")
        print("|---|---|---|---|---|")
        for name, us, gbs, err in rows:
            print(f"| {name} | {us:.2f} | {gbs:,.0f} | {100 * gbs / bw:.0f} % | {err:.1e} |")


if __name__ == "__main__":
    main()
