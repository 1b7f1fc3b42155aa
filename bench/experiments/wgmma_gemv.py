"""A few tokens times bf16 weights on the tensor cores (Mosaic GPU): decode's attention projections as a
bandwidth kernel, against XLA's product (cuBLAS) in the same process.

Why (issue 32, batch-1 decode at >= 60 % of the roofline): in GPT-OSS-20B's decode step cuBLAS streams q's and o's
bf16 weights at 2.1-2.25 TB/s (11.3 and 10.5 us a layer, session 34's profile on one H100) where the copy bandwidth
is 3.0 TB/s, and XLA computes k and v as one column reduce at 1.3 TB/s (4.5 us); the Triton GEMV of
bench/experiments/bf16_gemv.py stayed under 2.0 TB/s (loads that feed element-wise work are not pipelined). Here
TMA streams the weight tiles through a warp-specialized pipeline and `wgmma` reads them from shared memory as they
are: out^T [N, 8] = W^T [N, K] @ x^T [K, 8], the weight the left operand (its [K, N] tile read transposed, which
wgmma takes for 16-bit types), the (up to 8) tokens the right operand, so no instruction touches a weight byte
between the copy and the tensor core. 7/8 of the tensor-core work multiplies zero rows at batch 1 (~0.3 us of q's
product at the H100's rate), none at batch 8. K is split for enough programs (`splits`), the fp32 partials summed
outside in a fixed order (deterministic).

    python -m bench.experiments.wgmma_gemv [--variants NAME,...]   (GPU: each case over 24 distinct weights, GPU
                                                                      busy time a call from a profile)
    python -m pytest bench/experiments/test_wgmma_gemv.py          (CPU: the interpreter's values; the kernel's
                                                                      Mosaic GPU lowering for Hopper)

Measured (session 41, one H100 80GB HBM3, jax 0.11.2; q's 2880 x 4096 weights, 23.6 MB a call; the "XLA einsum"
row is the product timed alone, which at one token XLA does not give to cuBLAS as decode's program does, where q
took 11.3 us):

| tokens | XLA einsum | wgmma default (block_n 128) | wgmma n64 |
|---|---|---|---|
| 1 | 27.75 us (850 GB/s) | 15.23 us (1,549 GB/s, 51 % of copy) | 15.56 us |
| 8 | 12.25 us (1,927 GB/s) | 14.15 us (1,668 GB/s) | 14.56 us |

Below cuBLAS's 11.3 us in the decode program (2.1 TB/s) and below XLA's product at 8 tokens: not wired in.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tessera.lower.kernels import _mgpu

TOKENS = 8  # the right operand's columns: wgmma's smallest N
ROWS = 64  # output columns a consumer warpgroup (wgmma's M)


@dataclasses.dataclass(frozen=True)
class WgmmaGemvConfig:
    """block_n output columns a program (ROWS a consumer warpgroup), block_k weight rows a pipeline step, `stages`
    steps in flight; splits=0: K split for about `programs` programs (a divisor of the step count)."""
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    splits: int = 0
    programs: int = 264  # two an SM of an H100
    interpret: bool = False

    def __post_init__(self):
        check_tiles(self.block_n, self.stages)
        if self.block_k % 64:
            raise ValueError(f"{self.block_k=} must be a multiple of 64 (a 128-byte swizzled bf16 row)")

    @property
    def consumers(self) -> int:
        return self.block_n // ROWS


def check_tiles(block_n: int, stages: int) -> None:
    """A program's columns whole consumer warpgroups (at most 256, wgmma's widest), at least two steps in flight."""
    if block_n % ROWS or block_n > 256:
        raise ValueError(f"{block_n=} must be a multiple of {ROWS} up to 256")
    if stages < 2:
        raise ValueError(f"{stages=} must be at least 2")


def nearest_splits(steps: int, tiles: int, splits: int, programs: int) -> int:
    """K splits over `steps` pipeline steps: `splits`, or (0) the divisor of `steps` that brings `tiles` x splits
    programs closest to `programs`."""
    if splits:
        if steps % splits:
            raise ValueError(f"{splits=} must divide the {steps} K steps")
        return splits
    return min((s for s in range(1, steps + 1) if steps % s == 0), key=lambda s: abs(tiles * s - programs))


def splits_for(k: int, n: int, cfg: WgmmaGemvConfig) -> int:
    """K splits of this kernel (`nearest_splits` over its block_k steps and block_n tiles)."""
    return nearest_splits(k // cfg.block_k, n // cfg.block_n, cfg.splits, cfg.programs)


def warpgroup_kernel(body, *, interpret: bool, **kwargs):
    """`plgpu.kernel` in warpgroup semantics, or the CPU interpreter when `interpret`."""
    if interpret:
        return plgpu.kernel(body, interpret=_mgpu.interpret_params(), **kwargs)
    return plgpu.kernel(body, compiler_params=plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Warpgroup), **kwargs)


def summed_in_order(parts):
    """The split partials [splits, ...] summed in split order: a fixed order, the same bits every call."""
    total = parts[0]
    for i in range(1, parts.shape[0]):
        total = total + parts[i]
    return total


def supported(x, w, cfg: WgmmaGemvConfig) -> bool:
    """What the kernel takes: up to 8 tokens, bf16 or fp16, K a multiple of block_k, N of block_n."""
    (b, k), (k2, n) = x.shape, w.shape
    return (b <= TOKENS and k == k2 and x.dtype == w.dtype and jnp.dtype(w.dtype) in _mgpu.HALF_DTYPES
            and k % cfg.block_k == 0 and n % cfg.block_n == 0)


def _kernel(x_ref, w_ref, out_ref, *, cfg: WgmmaGemvConfig, per: int):
    """Program (n tile, K split): its consumers' [ROWS, 8] fp32 products over the split's `per` steps."""
    ni, s = lax.axis_index("n"), lax.axis_index("s")
    bn, bk, wgs = cfg.block_n, cfg.block_k, cfg.consumers
    tf = _mgpu.smem_transforms(w_ref.dtype)

    def run(scratch):
        def body(_, x_smem, w_smem, acc):
            wg = lax.axis_index("wg")
            w_cols = w_smem.at[:, pl.ds(wg * ROWS, ROWS)]  # [bk, ROWS]: this consumer's output columns
            if scratch is None:  # both operands read transposed, as wgmma takes 16-bit tiles
                plgpu.wgmma(acc, _mgpu.transposed(w_cols), _mgpu.transposed(x_smem))
            else:  # the interpreter (jax 0.10/0.11) has no transposed operands: copies of the transposes
                a_scr, b_scr = scratch[0].at[wg], scratch[1].at[wg]
                a_scr[...] = w_cols[...].T
                b_scr[...] = x_smem[...].T
                plgpu.wgmma(acc, a_scr, b_scr)
            plgpu.wgmma_wait(0)
            return acc

        def context(eval_pipeline):
            def with_acc(acc):
                eval_pipeline(acc)
                wg = lax.axis_index("wg")
                out_ref[s, pl.ds(ni * bn + wg * ROWS, ROWS), :] = acc[...]
            pl.run_scoped(with_acc, plgpu.ACC((ROWS, TOKENS), jnp.float32))

        pipeline = plgpu.emit_pipeline_warp_specialized(
            body, grid=(per,), memory_registers=40, wg_axis="wg", num_compute_wgs=wgs,
            max_concurrent_steps=cfg.stages, compute_context=context,
            in_specs=[plgpu.BlockSpec((TOKENS, bk), lambda kk: (0, kk), transforms=tf),
                      plgpu.BlockSpec((bk, bn), lambda kk: (kk, 0), transforms=tf)])
        k0 = s * per * bk
        pipeline(x_ref.at[:, pl.ds(k0, per * bk)], w_ref.at[pl.ds(k0, per * bk), pl.ds(ni * bn, bn)])

    if not cfg.interpret:
        run(None)
        return
    pl.run_scoped(lambda a, b: run((a, b)), plgpu.SMEM((wgs, ROWS, bk), w_ref.dtype),
                  plgpu.SMEM((wgs, bk, TOKENS), w_ref.dtype), collective_axes="wg")


def gemv(x, w, *, out_dtype=None, config: WgmmaGemvConfig | None = None):
    """x [B, K] @ w [K, N] -> [B, N] (B <= 8) with fp32 sums: the kernel's split partials summed in split order."""
    cfg = config or WgmmaGemvConfig()
    if not supported(x, w, cfg):
        raise ValueError(f"x {x.shape} {x.dtype} @ w {w.shape} {w.dtype} is not supported with {cfg}")
    (b, k), n = x.shape, w.shape[1]
    splits = splits_for(k, n, cfg)
    per = k // cfg.block_k // splits
    xt = jnp.pad(x, ((0, TOKENS - b), (0, 0))) if b < TOKENS else x
    call = functools.partial(_kernel, cfg=cfg, per=per)
    kern = warpgroup_kernel(call, interpret=cfg.interpret,
                            out_type=jax.ShapeDtypeStruct((splits, n, TOKENS), jnp.float32),
                            grid=(n // cfg.block_n, splits), grid_names=("n", "s"), num_threads=cfg.consumers + 1,
                            thread_name="wg")
    return summed_in_order(kern(xt, w))[:, :b].T.astype(out_dtype or x.dtype)


# ----------------------------------------------------------------------------- benchmark (GPU)

# GPT-OSS-20B's attention projections at decode (K, N): q, o, k and v
CASES = {"q 2880x4096": (2880, 4096), "o 4096x2880": (4096, 2880), "k 2880x512": (2880, 512)}
LAYERS = 24


def print_table(title: str, rows: dict, x, varying: list, exact, nbytes: float, bw: float) -> None:
    """A markdown table of `rows` ({name: fn(x, v)}): GPU busy time a call over `varying` (bench.trace.profile_us),
    GB/s of `nbytes` against the copy bandwidth `bw`, and the largest error of fn(x, varying[0]) against `exact`
    relative to its largest value. A variant that fails is a row saying why."""
    from bench.trace import profile_us

    print(f"\n## {title}")
    print("| variant | us a call | GB/s | % of copy | max err / max |")
    print("|---|---|---|---|---|")
    for name, fn in rows.items():
        try:
            us, _ = profile_us(fn, (x,), varying)
            got = jax.jit(fn)(x, varying[0]).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(got - exact)) / jnp.max(jnp.abs(exact)))
            gbs = nbytes / us / 1e3
            print(f"| {name} | {us:.2f} | {gbs:,.0f} | {100 * gbs / bw:.0f} % | {err:.1e} |", flush=True)
        except Exception as exc:  # noqa: BLE001 (a variant the compiler refuses is a row, not the end)
            print(f"| {name} | {type(exc).__name__}: {str(exc).splitlines()[0][:160]} | | | |", flush=True)


def _variants() -> dict:
    c = WgmmaGemvConfig
    return {"default": c(), "n64": c(block_n=64), "n256": c(block_n=256), "k128": c(block_k=128),
            "s3": c(stages=3), "s6": c(stages=6), "p132": c(programs=132), "p528": c(programs=528)}


def main(argv=None) -> int:
    from bench.timing import copy_bandwidth

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=None)
    ap.add_argument("--tokens", type=int, default=1)
    args = ap.parse_args(argv)
    variants = _variants()
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    bw = copy_bandwidth()
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, {args.tokens} token(s), copy bandwidth "
          f"{bw:,.0f} GB/s", flush=True)
    f32 = dict(preferred_element_type=jnp.float32)
    for case, (k, n) in CASES.items():
        kx, *kw = jax.random.split(jax.random.key(k + n), LAYERS + 1)
        x = jax.random.normal(kx, (args.tokens, k), jnp.float32).astype(jnp.bfloat16)
        ws = [(jax.random.normal(key, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16) for key in kw]
        exact = jnp.einsum("bk,kn->bn", x.astype(jnp.float32), ws[0].astype(jnp.float32), precision="highest")
        rows = {"XLA einsum": lambda x, w: jnp.einsum("bk,kn->bn", x, w, **f32).astype(x.dtype)}
        rows.update({f"wgmma {name}": functools.partial(lambda x, w, cfg: gemv(x, w, config=cfg), cfg=cfg)
                     for name, cfg in variants.items() if supported(x, ws[0], cfg)})
        print_table(f"{case}: K {k}, N {n} ({2 * k * n / 1e6:.1f} MB a call)", rows, x, ws, exact, 2 * k * n, bw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
