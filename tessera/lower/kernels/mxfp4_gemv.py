"""MXFP4 (token, expert) pairs as matrix-vector products on the FMA units (Pallas, Triton backend).

`mxfp4_matmul.pair_dot`'s default kernel (`pair_config`): out[r] = lhs[r] @ dequantize(rhs[experts[r]])
for unsorted pairs (decode of one token: `reference.moe.moe_pairs`), with no tile table to build. One
program per (pair, block_n columns, K split) walks its K range a scale group (16 code rows) at a time,
each code row one vector of block_n bytes (8 a thread at the default 1024 columns over 4 warps); four code
bytes at a time become E4M3 bytes (masks and a shift) that `cvt.rn.f16x2.e4m3x2` turns into values two an
instruction (`fp8_gemv.e4m3_ptx`, exact); x's (even, odd) bf16 pair is one 32-bit load; the 16 rows' products are
summed per column and scaled once by the group's scale row, read once. Split-K partials are fp32, summed
outside in a fixed order (deterministic). The grouped kernel (one row a run) masks 15 of its 16 dot rows
and reads each scale byte once per code row. Several matrices of one shape (an expert's gate and up) share
one launch: their N tiles follow one another in the grid, so a GPT-OSS layer's gate and up are one call and
one split-K sum instead of two (with the decode step's other kernel cuts, GPT-OSS-20B batch 1 went from 416.9
to 444.2 tok/s on an H200: docs/kernels-log.md, "Fewer kernels a decode step").

`pair_dot` on one H200, jax 0.11.2 (`python -m bench.mxfp4_gemv`: GPU busy time per call from a profile,
the split-K sum included, weights from HBM; copy 4218-4226 GB/s; GB/s count the R experts' codes and
scales; G = 32 and 128 within 1.5% of each other, G = 32 shown):

| R pairs | 2880 -> 2880: grouped | matrix-vector (default) | 2880 -> 5760: grouped | matrix-vector |
|---|---|---|---|---|
| 1 | 9.6 us (457 GB/s, 11 %) | 6.7 us (660 GB/s, 16 %) | 12.9 us (681 GB/s, 16 %) | 10.0 us (884 GB/s, 21 %) |
| 4 | 19.7 us (896 GB/s, 21 %) | 13.1 us (1342 GB/s, 32 %) | 33.8 us (1041 GB/s, 25 %) | 23.1 us (1529 GB/s, 36 %) |
| 8 | 33.0 us (1068 GB/s, 25 %) | 23.2 us (1519 GB/s, 36 %) | 61.1 us (1154 GB/s, 27 %) | 38.0 us (1857 GB/s, 44 %) |

At R = 4 the kernel itself took 11.6 / 21.5 us (1.52 / 1.64 TB/s, 36 / 39 % of copy) and the split-K sum
1.6 us. Nsight Compute (`python -m bench.experiments.ncu_gemv`) then found it issue-bound (3.0 instructions
a cycle, warps mostly "not selected"), at ~13 instructions a code byte: a third of them FMUL and FADD that
reached the GPU unfused, 16 % HADD2.F32 (fp16 -> fp32), 8 % the E4M3 conversions. With the products as
fused multiply-adds (`fma`) and ~3 programs an SM instead of ~4 (same run, H200, R = 4, G = 32, whole call):
2880 -> 5760 22.58 -> 18.94 us, 2880 -> 2880 12.81 -> 11.87 us (10.6 M instructions a call against 12.7 M).
Splitting K into q or q + 1 steps to hit the program count exactly (the SMs were active 72 % of the
call) measured within noise and was not kept. The variants measured and not kept (loads further ahead,
other tile widths, splits and conversions, [groups, 16, block_n] tiles): docs/kernels-log.md, "MXFP4
expert matmul".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tessera.lower.kernels._vma import common, out_struct
from tessera.lower.kernels.fp8_gemv import e4m3_ptx
from tessera.lower.kernels.mxfp4_matmul import FP16_SHIFT, _capability, _e2m1_to_f32, _scale_f32, _steps
from tessera.lower.reference import mxfp4 as ref


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One program per (pair, block_n columns, K split); a K step is `groups` scale groups (16 code rows
    each), its loads issued `ahead` steps early. dequant "e4m3": inline PTX makes four bytes' nibbles E4M3
    bytes, converted two an instruction (`fp8_gemv.e4m3_ptx`; compute capability 8.9+); "pair": inline PTX turns
    a code byte into its two values as one fp16 pair (`_PAIR_PTX`; below 8.9). The interpreter takes jnp
    ops for both. splits=0: enough K splits for ~`programs` programs. `pair_config` gives the default."""
    block_n: int = 256
    groups: int = 1
    splits: int = 0
    num_warps: int = 2
    num_stages: int = 1
    ahead: int = 1
    dequant: str = "e4m3"
    programs: int = 396  # splits=0: K splits until about this many programs (3 an SM of an H100 / H200)
    fma: bool = True  # products summed by fused multiply-adds (`fma`); False: a multiply and an add each
    interpret: bool = False

    def __post_init__(self):
        for name in ("block_n", "groups"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two (Triton tiles)")
        if self.block_n < 32:
            raise ValueError(f"{self.block_n=} must be >= 32")
        if self.splits < 0 or self.ahead < 0:
            raise ValueError(f"splits ({self.splits}) and ahead ({self.ahead}) must be >= 0")
        if self.dequant not in ("e4m3", "pair"):
            raise ValueError(f"dequant {self.dequant!r} is not one of e4m3, pair")


def pair_config(r: int, k: int, n: int, *, interpret: bool = False) -> GemvConfig:
    """`pair_dot`'s default: 1024 columns a program over 4 warps (8 code bytes a thread a row), loads one K
    step ahead, K split for ~3 programs an SM; the fp16-pair conversion below compute capability 8.9. It
    beat the grouped kernel at every R, G and shape measured (module docstring); the grouped kernel stays
    reachable with config=mxfp4_matmul.default_config(r, k, n, r)."""
    del r, k, n  # the K splits follow R and N in gemv_splits
    cc = _capability()
    dequant = "pair" if cc is not None and cc < (8, 9) else "e4m3"  # cvt from E4M3 needs sm_89
    return GemvConfig(block_n=1024, num_warps=4, dequant=dequant, interpret=interpret)


# Four code bytes (one register) -> the four values of one nibble in fp32, times 2^-6. A nibble
# s e1 e0 m placed in a byte as s 0 0 e1 e0 m 0 0 is the E4M3 pattern of its E2M1 value times 2^-6
# (the code 0.5 an E4M3 subnormal), so all four bytes are placed with two masks and a shift, and
# `fp8_gemv.e4m3_ptx` (cvt.rn.f16x2.e4m3x2, two values an instruction, then cvt.f32.f16) makes them fp32, exact.
# One sequence per nibble: Pallas lowers an inline-asm op with two results wrongly (jax 0.11.2:
# "2 outvars do not match 1 outvals").
# low nibble: magnitude bits 0-2 -> 2-4, sign bit 3 -> 7; high nibble: magnitude 4-6 -> 2-4, sign in place
_PLACE_LO = """and.b32 m, {x}, 0x07070707;
shl.b32 m, m, 2;
and.b32 s, {x}, 0x08080808;
shl.b32 s, s, 4;"""
_PLACE_HI = """shr.b32 m, {x}, 2;
and.b32 m, m, 0x1C1C1C1C;
and.b32 s, {x}, 0x80808080;"""
_E4M3_LO, _E4M3_HI = (e4m3_ptx("q", prelude=place.format(x="$4") + "\nor.b32 q, m, s;", regs=".reg .b32 m, s, q;")
                      for place in (_PLACE_LO, _PLACE_HI))
E4M3_SHIFT = 64.0  # the E4M3 values are the E2M1 values times 2^-6

# One code byte b -> its low nibble's value in the low fp16 half and its high nibble's in the high half,
# each the fp16 bit pattern s000 0mmm 0000 0000 (the E2M1 value times 2^-14, the code 0.5 a subnormal:
# fp16 -> fp32 conversion keeps it, exact). b * 0x200200 puts b's bits 0-2 at 9-11 and its bits 4-6 at
# 25-27; b * 0x1001000 puts bit 3 at 15 and bit 7 at 31 (no carries: the copies do not overlap).
_PAIR_BYTE = """bfe.u32 b, $4, {shift}, 8;
mul.lo.u32 t, b, 0x200200;
mul.lo.u32 u, b, 0x1001000;
and.b32 t, t, 0x0E000E00;
and.b32 u, u, 0x80008000;
or.b32 ${out}, t, u;"""
_PAIR_PTX = "{\n.reg .b32 b, t, u;\n" + "\n".join(_PAIR_BYTE.format(shift=8 * i, out=i) for i in range(4)) + "\n}"


def pair_halves(codes, *, ptx: bool):
    """uint8 code bytes -> int32 (low nibble, high nibble) fp16 pairs, each half the value times 2^-14
    (int32: Triton's inline asm takes no unsigned result)."""
    if ptx:
        out = jax.ShapeDtypeStruct(codes.shape, jnp.int32)
        return pltriton.elementwise_inline_asm(_PAIR_PTX, args=[codes], pack=4, constraints="=r,=r,=r,=r,r",
                                               result_shape_dtypes=[out])[0]
    c = codes.astype(jnp.int32)
    half = lambda nib: ((nib & 7) << 9) | ((nib & 8) << 12)
    return half(c & 15) | (half(c >> 4) << 16)  # a negative high nibble sets bit 31 (wraps in int32)


def nibbles_e4m3(codes, *, ptx: bool):
    """uint8 code bytes -> (low-nibble, high-nibble) values times 2^-6 in fp32 (`_E4M3_LO`, `_E4M3_HI`; off the GPU
    the same values from jnp ops)."""
    if ptx:
        out = jax.ShapeDtypeStruct(codes.shape, jnp.int32)
        return tuple(lax.bitcast_convert_type(
            pltriton.elementwise_inline_asm(asm, args=[codes], pack=4, constraints="=r,=r,=r,=r,r",
                                            result_shape_dtypes=[out])[0], jnp.float32)
            for asm in (_E4M3_LO, _E4M3_HI))
    c = codes.astype(jnp.int32)
    return tuple(_e2m1_to_f32(nib) * (FP16_SHIFT / E4M3_SHIFT) for nib in (c & 15, c >> 4))


def _nibbles_f32(codes, cfg: GemvConfig):
    """uint8 code bytes -> (low-nibble, high-nibble) values in fp32, times 1 / `_nibble_shift(cfg)`."""
    if cfg.dequant == "e4m3":
        return nibbles_e4m3(codes, ptx=not cfg.interpret)
    w = pair_halves(codes, ptx=not cfg.interpret)
    f = lambda h: lax.bitcast_convert_type(h.astype(jnp.uint16), jnp.float16).astype(jnp.float32)
    return f(w & 0xFFFF), f(w >> 16)


# a * b + c rounded once. Triton's multiply and add reach the GPU unfused here (jax 0.11.2: ncu counted
# 4.6 M FMUL and FADD and no FFMA in one call of this kernel), and they were a third of its instructions.
_FMA_PTX = """{
.reg .f32 a, b, c, d;
mov.b32 a, $1;
mov.b32 b, $2;
mov.b32 c, $3;
fma.rn.f32 d, a, b, c;
mov.b32 $0, d;
}"""


def fma(a, b, c, *, ptx: bool):
    """a * b + c in fp32, one rounding on the GPU (`_FMA_PTX`); off the GPU a multiply and an add (the
    reference's arithmetic). Scalars broadcast to the others' shape."""
    if not ptx:
        return a * b + c
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b), jnp.shape(c))
    bits = lambda v: lax.bitcast_convert_type(jnp.broadcast_to(jnp.asarray(v, jnp.float32), shape), jnp.int32)
    out = pltriton.elementwise_inline_asm(_FMA_PTX, args=[bits(a), bits(b), bits(c)], pack=1,
                                          constraints="=r,r,r,r",
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.int32)])[0]
    return lax.bitcast_convert_type(out, jnp.float32)


def _nibble_shift(cfg: GemvConfig) -> float:
    return E4M3_SHIFT if cfg.dequant == "e4m3" else FP16_SHIFT


def _x_pair(words):
    """uint32 words holding lhs's (even, odd) bf16 pair -> the two in fp32 (exact)."""
    return (lax.bitcast_convert_type(words << 16, jnp.float32),
            lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32))


def _gemv_kernel(ex_ref, xw_ref, *refs, cfg: GemvConfig, rows: int, k: int, n: int, steps_per_split: int,
                 count: int, per: int = 1):
    """One (pair, N tile, K split): out[r, tile] = lhs[r, K range] @ dequantised expert columns (flat refs).

    `count` matrices of one shape (refs: their codes, then their scales, then out) share the launch: the N tiles
    of matrix j follow those of matrix j - 1 in the grid, and each program runs the loop of its own matrix. Each
    code row is one vector of block_n bytes; each scale row is read once for its 16 code rows. Code rows past K/2
    (the last step when `groups` scale groups do not divide K) read as zeros. Pair r reads lhs row r // per.
    """
    codes_refs, scales_refs, out_ref = refs[:count], refs[count:2 * count], refs[2 * count]
    tiles = -(-n // cfg.block_n)
    r, nt, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    for j in range(count):
        tile = functools.partial(_gemv_tile, ex_ref, xw_ref, codes_refs[j], scales_refs[j], out_ref, r,
                                 nt - j * tiles if j else nt, s, j, cfg=cfg, rows=rows, k=k, n=n,
                                 steps_per_split=steps_per_split, count=count, per=per)
        if count == 1:
            tile()  # one matrix: no branch
        else:
            pl.when(nt // tiles == j)(tile)


def _span(ex_ref, r, ni, s, bn: int, cfg: GemvConfig, k: int, n: int, steps_per_split: int, per: int = 1):
    """A program's part: its columns c and which are in range, K/2 code rows, where its expert's codes and scales and
    its pair's x start, and its K steps [lo, hi)."""
    e = ex_ref[r]
    c = ni * bn + jnp.arange(bn, dtype=jnp.int32)
    kh = k // 2
    lo = s * steps_per_split
    return (c, c < n, kh, e * kh, e * (k // 32), (r // per) * kh, lo,
            jnp.minimum(lo + steps_per_split, gemv_steps(k, cfg)))


def _gemv_tile(ex_ref, xw_ref, codes_ref, scales_ref, out_ref, r, ni, s, which: int, *, cfg: GemvConfig, rows: int,
               k: int, n: int, steps_per_split: int, count: int, per: int):
    """`_gemv_kernel`'s program for N tile `ni` of matrix `which`."""
    bn, gq = cfg.block_n, cfg.groups
    c, col_ok, kh, code_base, scale_base, x_base, lo, hi = _span(ex_ref, r, ni, s, bn, cfg, k, n, steps_per_split,
                                                                 per)

    def load(kk, live):
        codes, xs, scs = [], [], []
        for i in range(16 * gq):
            j = kk * (16 * gq) + i  # code row within the expert
            ok = live & (j < kh)
            codes.append(pltriton.load(codes_ref.at[(code_base + j) * n + c], mask=col_ok & ok, other=0))
            xs.append(jnp.where(ok, xw_ref[x_base + jnp.minimum(j, kh - 1)], jnp.uint32(0)))
        for q in range(gq):
            g = kk * gq + q
            ok = live & (g < k // 32)
            scs.append(pltriton.load(scales_ref.at[(scale_base + g) * n + c], mask=col_ok & ok, other=0))
        return tuple(codes), tuple(xs), tuple(scs)

    fused = functools.partial(fma, ptx=cfg.fma and not cfg.interpret)

    def step(tiles, acc):
        codes, xs, scs = tiles
        for q in range(gq):
            part = None  # the group's 32 products per column, summed in K order
            for i in range(16 * q, 16 * (q + 1)):
                w_lo, w_hi = _nibbles_f32(codes[i], cfg)
                x_e, x_o = _x_pair(xs[i])
                part = x_e * w_lo if part is None else fused(x_e, w_lo, part)
                part = fused(x_o, w_hi, part)
            acc = fused(_scale_f32(scs[q]), part, acc)
        return acc

    acc = _steps(load, step, lo, hi, jnp.zeros((bn,), jnp.float32), ahead=cfg.ahead)
    out = (acc * _nibble_shift(cfg)).astype(out_ref.dtype)
    pltriton.store(out_ref.at[((s * count + which) * rows + r) * n + c], out, mask=col_ok)


def gemv_steps(k: int, cfg: GemvConfig) -> int:
    """K steps of `groups` scale groups (the last one masked where they do not divide K)."""
    return -(-k // (32 * cfg.groups))


def gemv_splits(r: int, k: int, n: int, cfg: GemvConfig) -> int:
    """K splits: cfg.splits, or (0) enough for ~cfg.programs programs, at most one per K step."""
    steps = gemv_steps(k, cfg)
    want = cfg.splits or -(-cfg.programs // (r * -(-n // cfg.block_n)))
    per = -(-steps // max(1, min(want, steps)))
    return -(-steps // per)  # no empty splits


def gemv_parts(lhs, rhs, experts, cfg: GemvConfig, out_dtype, *, per: int = 1):
    """`_gemv_kernel`'s output before the split-K sum: [splits, count, R, N], pair r = lhs[r // per] @
    dequantise(rhs[experts[r]]) (lhs [R / per, K]), in fp32 where K is split, else in out_dtype. `rhs` one MXFP4 matrix
    or a tuple of them of one shape (count of them, one launch)."""
    mats = rhs if ref.several(rhs) else (rhs,)
    t, k = lhs.shape
    r = experts.shape[0]
    if t * per != r:
        raise ValueError(f"{t} lhs rows each serving {per} pairs are not the {r} pairs of `experts`")
    g, _, n = mats[0].shape
    if any(m.shape != mats[0].shape for m in mats):
        raise ValueError(f"one launch takes matrices of one shape, not {[m.shape for m in mats]}")
    count = len(mats)
    splits = gemv_splits(r, k, n * count, cfg)
    per_split = -(-gemv_steps(k, cfg) // splits)  # K steps a split
    part_dtype = out_dtype if splits == 1 else jnp.float32
    body = functools.partial(_gemv_kernel, cfg=cfg, rows=r, k=k, n=n, steps_per_split=per_split, count=count, per=per)
    xw = lax.bitcast_convert_type(lhs.reshape(t, k // 2, 2), jnp.uint32).reshape(-1)  # (even, odd) bf16 pairs
    flat = [m.codes.reshape(-1) for m in mats] + [m.scales.reshape(-1) for m in mats]
    experts, xw, *flat = common(experts, xw, *flat)
    out = pl.pallas_call(
        body,
        out_shape=out_struct((splits * count * r * n,), part_dtype, xw),
        grid=(r, count * -(-n // cfg.block_n), splits),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="mxfp4_pair_gemv",
    )(experts, xw, *flat)
    return out.reshape(splits, count, r, n)


def gemv(lhs, rhs, experts, cfg: GemvConfig, out_dtype):
    """out [R, N] = lhs[r] @ dequantise(rhs[experts[r]]) by `_gemv_kernel` (fp32 split partials summed). `rhs` a
    tuple of MXFP4 matrices of one shape (an expert's gate and up): one launch, a tuple of outputs.

    Forward only: `mxfp4_matmul.pair_dot` is the differentiable op."""
    out = gemv_parts(lhs, rhs, experts, cfg, out_dtype)
    if out.shape[0] == 1:
        out = out[0]
    else:
        # The split-K sum as a reduce of its own: fused into its consumer (the expert combine, the residual
        # add), XLA made one loop fusion of ~2,900 threads, each summing 30 splits x 4 pairs strided; with the
        # barrier, GPT-OSS-20B's batch-1 decode ran 4.6 % faster on an H100 (bench/experiments/decode_variants).
        out = lax.optimization_barrier(out.sum(axis=0).astype(out_dtype))
    return tuple(out) if ref.several(rhs) else out[0]
