"""MXFP4 (token, expert) pairs on the tensor cores (Mosaic GPU): the decode GEMV of tessera/lower/kernels/mxfp4_gemv.py
with the multiply-adds moved off the FMA units, against it in the same process.

Why (issue 32): batch-1 decode spends ~31 us a GPT-OSS-20B layer in the MXFP4 GEMV where its bytes take ~18 at the
copy bandwidth; the FMA kernel is issue-bound at ~8 instructions a code byte, about 4 of them the two fp16 -> fp32
conversions and the two fp32 multiply-adds a byte's two values need (docs/kernels-log.md, "MXFP4 expert matmul").
Here those go to `wgmma`: a consumer warpgroup turns a scale group's [16 code rows, 64 columns] into bf16 values in
shared memory (integer operations on the code bytes: no float arithmetic), and `wgmma` multiplies them, read
transposed as the left operand [64 columns, 32 values], by the tokens (the right operand [32, 8]); the group's
[64, 8] product is scaled by its columns' E8M0 scales in fp32 and added to the running sum. Codes stay in Tessera's
[E, K/2, N] layout (the left operand would want them K-contiguous in registers, which Mosaic GPU does not load from
an N-contiguous 8-bit tile: docs/kernels-log.md), so a group's values are written as its 16 even k then its 16 odd
k, and x takes the same order within each group (`_grouped_x`). K is split for enough programs; the fp32 partials
are summed outside in split order (deterministic).

    python -m bench.experiments.mxfp4_wgmma_gemv   (GPU: GPT-OSS-20B's gate+up and down at R = 4 pairs, against
                                                    pair_dot's FMA kernel; GPU busy time a call from a profile)
    python -m pytest bench/experiments/test_mxfp4_wgmma_gemv.py   (CPU: the integer route to bf16 bits)

Status (session 40, written without a device): the integer route to bf16 bits is checked against the reference for
every code and scale 2..252, the interpreted kernel against the fp32 product, and the kernel lowers for Hopper on the
CPU (jax 0.10.2) at GPT-OSS-20B's shapes; not yet run on a GPU. What lowers, found on the way: the codes' tile
unswizzled (a 64-byte-swizzled byte tile in the pipeline fails layout inference, a 64-column slice of a 128-byte one
is refused), one consumer warpgroup (two 64-column slices of the unswizzled tile fail layout inference: `block_n` 64),
the scales widened in registers (a group's [64] row loaded in the codes' layout's column vector, broadcast and
selected by the row's group; 64 row stores through shared memory did not lower). K off the 128-value step (GPT-OSS's
2880) reads the last tile past K: TMA fills those rows with zeros (and x is zero there), which the GPU run's error
column checks; the interpreter hangs on it.

Measured (session 41, one H100 80GB HBM3, jax 0.11.2, R = 4; the error column within 7.5e-7 of the largest value,
so the TMA zero fill past K holds): gate+up 94.5 us (373 GB/s, 12 % of copy) at 4 stages, 99.6 at 6, against the FMA
kernel's 20.8 us; down 64.9 / 66.5 us against 12.7. 4.5-5x slower: the consumer's integer widening of a step (a
warpgroup's ~5 operations a value, as many instructions a code byte as the FMA kernel's conversion and
multiply-adds) runs between the copy and the tensor core with one warpgroup a program, so nothing overlaps it; the
tensor-core route needs the conversion cheaper than the FMA route's, not only moved. Not wired in.
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

from bench.experiments.wgmma_gemv import (ROWS, TOKENS, check_tiles, nearest_splits, summed_in_order,
                                          warpgroup_kernel)
from tessera.lower.kernels import _mgpu
from tessera.lower.reference import mxfp4 as ref

# TOKENS: the right operand's columns are the pairs' x rows, each program keeps its own
GROUP = 32  # values a scale covers (16 code rows)
STEP = 128  # values a pipeline step: 64 code rows, 4 scale groups


@dataclasses.dataclass(frozen=True)
class WgmmaPairConfig:
    """block_n output columns a program (ROWS a consumer warpgroup), `stages` scale groups in flight; splits=0: K
    split for about `programs` programs (a divisor of K / 32)."""
    block_n: int = 64  # one consumer: two, each a 64-column slice of an unswizzled byte tile, fail layout inference
    stages: int = 6
    splits: int = 0
    programs: int = 396  # three an SM of an H100
    interpret: bool = False

    def __post_init__(self):
        check_tiles(self.block_n, self.stages)
        if self.block_n > ROWS and not self.interpret:
            raise ValueError(f"{self.block_n=}: one consumer warpgroup ({ROWS} columns) until the byte tile's "
                             "slices lower")


def supported(lhs, rhs: ref.MXFP4, cfg: WgmmaPairConfig) -> bool:
    """Up to 8 pairs, bf16 rows, K a multiple of 128 (GPT-OSS's 2880 is not: padded, see `pair_gemv`), N of block_n."""
    r, k = lhs.shape
    return r <= TOKENS and lhs.dtype == jnp.bfloat16 and rhs.shape[-1] % cfg.block_n == 0


def _grouped_x(lhs, k_pad: int):
    """lhs [R, K] padded to [8, k_pad] (zeros), each step's 128 values reordered as its 64 even k, then its 64 odd k:
    the order in which the kernel writes a step's values (a code row's low nibble is k = 2j, its high nibble 2j + 1)."""
    r, k = lhs.shape
    x = jnp.pad(lhs, ((0, TOKENS - r), (0, k_pad - k)))
    x = x.reshape(TOKENS, k_pad // STEP, STEP // 2, 2)
    return jnp.swapaxes(x, 2, 3).reshape(TOKENS, k_pad)


def _bf16_bits(nib, scale):
    """int32 E2M1 codes (0..15) and E8M0 scale bytes -> the bf16 bits of value x 2^(scale - 127), by integer
    operations: a magnitude m >= 1 is 0x3F00 (0.5) for m = 1 and 0x3F00 + (m << 6) from m = 2 (1, 1.5, 2, 3, 4, 6:
    exponent and mantissa step together), the scale added to the exponent field; zero stays zero. Exact for the
    scales real checkpoints hold (the product a normal bf16: 2^(scale - 127) x 6 below 2^128, x 0.5 above 2^-126)."""
    mag = nib & 7
    base = jnp.where(mag >= 2, 0x3F00 + (mag << 6), 0x3F00)
    bits = jnp.where(mag == 0, 0, base + ((scale - 127) << 7))
    return bits | ((nib & 8) << 12)


def _kernel(ex_ref, x_ref, codes_ref, scales_ref, out_ref, *, cfg: WgmmaPairConfig, per: int):
    """Program (pair, n tile, K split): its consumers' [ROWS, 8] fp32 sums over the split's `per` steps (STEP values
    each: 64 code rows, 4 scale groups)."""
    r, ni, s = lax.axis_index("r"), lax.axis_index("n"), lax.axis_index("s")
    bn, wgs = cfg.block_n, cfg.block_n // ROWS
    e = ex_ref[r]
    rows = STEP // 2  # code rows a step
    x_tf = _mgpu.smem_transforms(jnp.bfloat16)
    c_tf = ()  # unswizzled: Mosaic GPU's layout inference fails on a 64-byte-swizzled byte tile in the pipeline
    layout = plgpu.Layout.WGMMA_8BIT  # a [64, 64] byte tile's registers (Mosaic GPU stores them to the bf16 tile)

    def run(a_smem, scratch):
        interpret = scratch is not None
        def body(_, x_smem, c_smem, s_smem, acc):
            wg = lax.axis_index("wg")
            cols = pl.ds(wg * ROWS, ROWS)
            load = (lambda ref: ref[...]) if interpret else functools.partial(_mgpu.load, layout=layout)
            codes = load(c_smem.at[:, cols]).astype(jnp.int32)  # [64, ROWS]
            if interpret:
                scale = jnp.repeat(s_smem[:, cols].astype(jnp.int32), GROUP // 2, axis=0)
            else:  # each group's scale row broadcast over its 16 code rows, in the codes' layout
                group = plgpu.broadcasted_iota(jnp.int32, (rows, ROWS), 0, layout=layout) >> 4
                scale = jnp.zeros((rows, ROWS), jnp.int32)
                for g in range(STEP // GROUP):
                    row = _mgpu.load(s_smem.at[g, cols], layout=layout.reduce(0)).astype(jnp.int32)
                    scale = jnp.where(group == g, lax.broadcast_in_dim(row, (rows, ROWS), [1]), scale)
            a = a_smem.at[wg]  # [STEP, ROWS] bf16: the step's 64 even k, then its 64 odd k
            for half, nib in ((0, codes & 15), (1, codes >> 4)):
                a[pl.ds(half * rows, rows)] = lax.bitcast_convert_type(
                    _bf16_bits(nib, scale).astype(jnp.uint16), jnp.bfloat16)
            if interpret:  # the interpreter (jax 0.10/0.11) has no transposed operands: copies of the transposes
                a_t, x_t = scratch[0].at[wg], scratch[1].at[wg]
                a_t[...] = a[...].T
                x_t[...] = x_smem[...].T
                plgpu.wgmma(acc, a_t, x_t)
            else:
                plgpu.commit_smem()  # the generic-proxy stores seen by wgmma's async reads
                plgpu.wgmma(acc, _mgpu.transposed(a), _mgpu.transposed(x_smem))
            plgpu.wgmma_wait(0)
            return acc

        def context(eval_pipeline):
            def with_acc(acc):
                eval_pipeline(acc)
                wg = lax.axis_index("wg")
                out_ref[s, r, pl.ds(ni * bn + wg * ROWS, ROWS), :] = acc[...]
            pl.run_scoped(with_acc, plgpu.ACC((ROWS, TOKENS), jnp.float32))

        pipeline = plgpu.emit_pipeline_warp_specialized(
            body, grid=(per,), memory_registers=40, wg_axis="wg", num_compute_wgs=wgs,
            max_concurrent_steps=cfg.stages, compute_context=context,
            in_specs=[plgpu.BlockSpec((TOKENS, STEP), lambda kk: (0, kk), transforms=x_tf),
                      plgpu.BlockSpec((rows, bn), lambda kk: (kk, 0), transforms=c_tf),
                      plgpu.BlockSpec((STEP // GROUP, bn), lambda kk: (kk, 0))])
        k0 = s * per * STEP
        pipeline(x_ref.at[:, pl.ds(k0, per * STEP)],
                 codes_ref.at[e, pl.ds(k0 // 2, per * rows), pl.ds(ni * bn, bn)],
                 scales_ref.at[e, pl.ds(k0 // GROUP, per * STEP // GROUP), pl.ds(ni * bn, bn)])

    scoped = [plgpu.SMEM((wgs, STEP, ROWS), jnp.bfloat16, transforms=_mgpu.smem_transforms(jnp.bfloat16))]
    if not cfg.interpret:
        pl.run_scoped(lambda a: run(a, None), *scoped, collective_axes="wg")
        return
    scoped += [plgpu.SMEM((wgs, ROWS, STEP), jnp.bfloat16), plgpu.SMEM((wgs, STEP, TOKENS), jnp.bfloat16)]
    pl.run_scoped(lambda a, at, xt: run(a, (at, xt)), *scoped, collective_axes="wg")


def pair_gemv(lhs, rhs: ref.MXFP4, experts, *, out_dtype=jnp.float32, config: WgmmaPairConfig | None = None):
    """out [R, N] = lhs[r] @ dequantize(rhs[experts[r]]) (R <= 8), fp32 sums; the split partials summed in order."""
    cfg = config or WgmmaPairConfig()
    if not supported(lhs, rhs, cfg):
        raise ValueError(f"lhs {lhs.shape} {lhs.dtype} with experts {rhs.shape} is not supported with {cfg}")
    r, k = lhs.shape
    n = rhs.shape[-1]
    k_pad = -(-k // STEP) * STEP  # the codes' tail steps read past K: TMA fills zeros, and x is zero there
    splits = nearest_splits(k_pad // STEP, r * n // cfg.block_n, cfg.splits, cfg.programs)
    call = functools.partial(_kernel, cfg=cfg, per=k_pad // STEP // splits)
    kern = warpgroup_kernel(call, interpret=cfg.interpret,
                            out_type=jax.ShapeDtypeStruct((splits, r, n, TOKENS), jnp.float32),
                            grid=(r, n // cfg.block_n, splits), grid_names=("r", "n", "s"),
                            num_threads=cfg.block_n // ROWS + 1, thread_name="wg")
    total = summed_in_order(kern(experts.astype(jnp.int32), _grouped_x(lhs, k_pad), rhs.codes, rhs.scales))
    return total[jnp.arange(r), :, jnp.arange(r)].astype(out_dtype)  # pair r's own column of the tokens


# ----------------------------------------------------------------------------- benchmark (GPU)

CASES = {"gate+up 2880x5760": (2880, 5760), "down 2880x2880": (2880, 2880)}
EXPERTS, PAIRS, LAYERS = 32, 4, 24


def main(argv=None) -> int:
    from bench.experiments.wgmma_gemv import print_table
    from bench.timing import copy_bandwidth
    from tessera.lower.kernels.mxfp4_matmul import pair_dot

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="4,6")
    args = ap.parse_args(argv)
    bw = copy_bandwidth()
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, R = {PAIRS}, copy bandwidth {bw:,.0f} GB/s",
          flush=True)
    for case, (k, n) in CASES.items():
        key = jax.random.key(k + n)
        kx, ke, *kw = jax.random.split(key, LAYERS + 2)
        x = jax.random.normal(kx, (PAIRS, k), jnp.float32).astype(jnp.bfloat16)
        experts = jax.random.choice(ke, EXPERTS, (PAIRS,), replace=False).astype(jnp.int32)
        mats = [ref.MXFP4(jax.random.randint(kk, (EXPERTS, k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8),
                          jax.random.randint(jax.random.fold_in(kk, 1), (EXPERTS, k // 32, n), 118, 124,
                                             jnp.int32).astype(jnp.uint8)) for kk in kw]
        want = ref.pair_dot(x.astype(jnp.float32), mats[0], experts, preferred_element_type=jnp.float32)
        rows = {"pair_dot (FMA kernel)": lambda x, m: pair_dot(x, m, experts, preferred_element_type=jnp.float32)}
        for st in (int(v) for v in args.stages.split(",")):
            cfg = WgmmaPairConfig(stages=st)
            rows[f"wgmma stages {st}"] = functools.partial(lambda x, m, cfg: pair_gemv(x, m, experts, config=cfg),
                                                           cfg=cfg)
        nbytes = PAIRS * (k * n // 2 + k * n // 32)
        print_table(f"{case}: {nbytes / 1e6:.1f} MB of the pairs' codes and scales a call", rows, x, mats, want,
                    nbytes, bw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
