"""Weight-only MXFP4 grouped matmul (MoE experts) that dequantises in registers (Pallas, Triton backend).

Semantics: `reference.mxfp4.ragged_dot`: lhs [M, K] rows sorted by group, packed experts rhs [G, K, N]
(codes uint8 [G, K/2, N], low nibble = even k; scales uint8 [G, K/32, N]), group_sizes [G] (sum <= M,
rows past the sum give 0, empty groups allowed): out[r] = lhs[r] @ dequantize(rhs[group(r)]).

The packed layout splits the product without interleaving nibbles:
    x @ W = x[:, 0::2] @ W_lo + x[:, 1::2] @ W_hi        (W_lo / W_hi: the low / high nibbles, [K/2, N])
A tile table built outside the kernel lists, per group, its runs of up to `block_m` consecutive rows
(groups need not start on a block boundary: rows are gathered, so each expert's weights are read once
per run, and at decode sizes once). Each program takes one table entry x one N tile x one of `splits`
K ranges: it streams [block_k/2, block_n] code bytes and their scales, turns four code bytes at a
time into eight bf16 weights with inline-PTX bit sequences (`dequantize_tile`: byte permutes, masks
and two bf16x2 FMAs, exact) and feeds two tensor-core dots. Split-K partials (fp32) are summed
outside; at decode M that buffer is tiny.

`pair_dot` multiplies unsorted (row, expert) pairs (decode of one token: `reference.moe.moe_pairs`),
with no table to build. By default (`pair_config`) it runs a matrix-vector kernel on the FMA units
(`GemvConfig`, `_gemv_kernel`): one program per (pair, 1024 columns, K split) walks its K range a scale
group (16 code rows) at a time, each code row one vector of 8 bytes a thread; four code bytes at a time
become E4M3 bytes (masks and a shift) that `cvt.rn.f16x2.e4m3x2` turns into values two an instruction
(`_E4M3_PTX`, exact); x's (even, odd) bf16 pair is one 32-bit load; the 16 rows' products are summed per
column and scaled once by the group's scale row, read once. The grouped kernel (one row a run,
`config=default_config(r, k, n, r)`) masks 15 of its 16 dot rows and reads each scale byte once per
code row.

Backend: `pl.pallas_call` lowered through Triton (jax 0.10-0.12; CPU interpreter for CI). Forward only;
the gradient w.r.t. lhs goes through the reference (dequantised weights), packed weights get none.

block_m < 16 takes the products on the FMA units instead (`_step_fma`); at decode it measured no
faster than 16-row dots (bench/RESULTS.md), so the defaults keep the dots.

Measured on an H200 (bench/RESULTS.md, profile busy time, 2880 -> 2880 unless said): one token's 4
experts (17.7 MB) in 22.8 us (776 GB/s), 8 tokens in 86 us, 2880 -> 5760 at 4096 rows in 0.88 ms; the
E4M3 route converting one nibble at a time took 33.8 / 137 / 1345 us, of which the inline PTX saved
~15% and issuing each K step's loads one step early (`Mxfp4Config.ahead`) the rest.

`pair_dot` on one H200, jax 0.11.2 (`python -m bench.mxfp4_gemv`: GPU busy time per call from a
profile, the split-K sum included, weights from HBM; copy 4218-4226 GB/s; GB/s count the R experts'
codes and scales; G = 32 and 128 within 1.5% of each other, G = 32 shown):

| R pairs | 2880 -> 2880: grouped | matrix-vector (default) | 2880 -> 5760: grouped | matrix-vector |
|---|---|---|---|---|
| 1 | 9.6 us (457 GB/s, 11 %) | 6.7 us (660 GB/s, 16 %) | 12.9 us (681 GB/s, 16 %) | 10.0 us (884 GB/s, 21 %) |
| 4 | 19.7 us (896 GB/s, 21 %) | 13.1 us (1342 GB/s, 32 %) | 33.8 us (1041 GB/s, 25 %) | 23.1 us (1529 GB/s, 36 %) |
| 8 | 33.0 us (1068 GB/s, 25 %) | 23.2 us (1519 GB/s, 36 %) | 61.1 us (1154 GB/s, 27 %) | 38.0 us (1857 GB/s, 44 %) |

At R = 4 the matrix-vector kernel itself takes 11.6 / 21.5 us (1.52 / 1.64 TB/s, 36 / 39 % of copy)
and the split-K sum 1.6 us; the 60 % of copy aimed at is not reached. Variants at R = 4 (2880 -> 5760 /
2880 -> 2880, us; the default 23.0 / 13.1), none faster on both shapes: loads two or three steps ahead
27.3 / 15.4 and 28.3 / 17.5; 512 columns over 2 or 4 warps 22.6 / 14.3 and 24.5 / 15.3; 2048 columns
22.6 / 16.9; two scale groups a step 24.7 / 14.8; K split for ~8 programs an SM 21.9 / 14.8, 8 or 16
fixed splits 27.4 / 20.7 and 21.5 / 16.1; the fp16-pair PTX (`dequant="pair"`) 26.6 / 14.7;
[groups, 16, block_n] tiles (`layout="tile"`) 34.0-34.4 / 15.1-19.2. About 8 instructions a code byte
(conversion ~5, two FMAs) at the few warps an SM these grids give is the likely limit (not profiled).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tessera.lower.kernels._tables import cumsum
from tessera.lower.kernels._vma import common, out_struct
from tessera.lower.reference import mxfp4 as ref

DTYPES = (jnp.dtype(jnp.bfloat16),)
FP16_SHIFT = 16384.0  # E2M1 bits read as fp16 are the value times 2^-14


@dataclasses.dataclass(frozen=True)
class Mxfp4Config:
    """block_m rows x block_n columns per program, block_k of K per step (the last step masked where
    block_k does not divide K), K split `splits` ways."""
    block_m: int = 16
    block_n: int = 128
    block_k: int = 64
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3
    ahead: int = 1  # K steps whose loads are issued before the current one is computed
    interpret: bool = False  # the Pallas interpreter (CPU)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            low = 1 if name == "block_m" else 16
            if v < low or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two >= {low} (Triton tiles)")
        if self.block_k < 32:
            raise ValueError(f"{self.block_k=} must be >= 32 (one MXFP4 scale group)")
        if self.splits < 1:
            raise ValueError(f"{self.splits=} must be >= 1")
        if self.ahead < 0:
            raise ValueError(f"{self.ahead=} must be >= 0")


def _block_k(k: int) -> int:
    """The largest power-of-two step <= 256 that divides K (K=2880: 64)."""
    return next(b for b in (256, 128, 64, 32) if k % b == 0)


def default_config(m: int, k: int, n: int, g: int, *, interpret: bool = False) -> Mxfp4Config:
    """Decode (few rows per expert): 16 x 64 tiles, K split 6 ways (3 from 32 rows); prefill: 64 x 128,
    K split until ~4 programs per SM.

    Decode, measured on an H200 (bench.kernels tune_mxfp4, profile busy time, 2880 -> 2880): 64-wide
    K steps split 6 ways beat the old 128-column tiles (M4: 33.6 vs 35.0 us; M32: 137 vs 156 us; M256
    equal); wider K steps (128-512, one or a few per program) were slower at every M (36-63 us at M4).
    With the PTX dequantisation, loads one step ahead beat two or three ahead at every size (M4: 22.8
    vs 24.3 / 26.2 us; 4096 rows: 0.88 vs 1.26 ms for two); 3 K splits beat 6 from M32 on (84.2 vs
    86.0 us; M256: 124.1 vs 129.0) but not at M4 (27.5 vs 22.4).
    """
    rows_per_group = max(1, m // max(g, 1))
    steps = k // _block_k(k)
    if rows_per_group <= 16:  # from 8 tokens on, most experts hold rows: fewer K splits suffice
        splits = max(1, min(6 if m < 32 else 3, steps // 4))
        return Mxfp4Config(block_m=16, block_n=64, block_k=_block_k(k), splits=splits, interpret=interpret)
    block_n = 128
    programs = (-(-m // 64) + g) * -(-n // block_n)
    splits = max(1, min(8, steps // 4, -(-528 // programs)))  # 528 = 4 x 132 SMs
    return Mxfp4Config(block_m=64, block_n=block_n, block_k=_block_k(k), splits=splits, interpret=interpret)


def _capability() -> tuple[int, int] | None:
    """The first device's CUDA compute capability, None off a CUDA GPU."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    if dev.platform != "gpu":
        return None
    cc = str(getattr(dev, "compute_capability", "0"))
    return tuple(int(p) for p in (cc.split(".") + ["0"])[:2])


def _on_gpu() -> bool:
    """A CUDA GPU with bf16x2 FMAs (compute capability >= 8.0; the kernel is measured on Hopper only)."""
    cc = _capability()
    return cc is not None and cc >= (8, 0)


def supported(lhs, rhs, group_sizes, config: Mxfp4Config | GemvConfig | None = None) -> bool:
    """GPU (or the interpreter), bf16 lhs [M, K], packed rhs [G, K, N], int group_sizes [G], K % 32 == 0."""
    if not isinstance(rhs, ref.MXFP4) or rhs.codes.ndim != 3 or lhs.ndim != 2:
        return False
    if not ((config is not None and config.interpret) or _on_gpu()):
        return False
    g, k, n = rhs.shape
    if lhs.shape[1] != k or k % ref.GROUP or group_sizes.shape != (g,):
        return False
    if rhs.codes.dtype != jnp.uint8 or rhs.scales.dtype != jnp.uint8 or rhs.scales.shape != (g, k // 32, n):
        return False
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer) or jnp.dtype(lhs.dtype) not in DTYPES:
        return False
    return rhs.codes.size < 2**31 and lhs.size < 2**31  # Triton's int32 offsets


def _tile_table(group_sizes, m: int, block_m: int):
    """int32 [cdiv(m, bm) + min(G, m) + 1, 3]: (group, first row, rows) per run of <= bm rows of one group.

    Rows past sum(group_sizes) form a virtual group G whose tiles store zeros (ragged_dot's 0);
    entries past the last run have 0 rows. At most min(G, m) groups hold rows, and each adds at
    most one partial run, so the table (and the kernel's grid) stays at a few entries at decode
    however many experts there are: an empty program still costs its launch (G = 128, M = 4 on an
    H200: 53-166 us a call over all 130 entries, 35 us over the 6 that can hold rows).
    """
    ends = jnp.minimum(cumsum(group_sizes.astype(jnp.int32)), m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])  # + the tail group
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    count = (ends - starts + block_m - 1) // block_m  # runs per group
    offsets = cumsum(count)
    t = jnp.arange(-(-m // block_m) + min(ends.shape[0] - 1, m) + 1, dtype=jnp.int32)
    # compare_all: one [T, G] comparison (the default binary search is a device loop, ~100 us at decode)
    grp = jnp.searchsorted(offsets, t, side="right", method="compare_all")
    grp = jnp.minimum(grp, ends.shape[0] - 1).astype(jnp.int32)
    row0 = starts[grp] + (t - offsets[grp] + count[grp]) * block_m
    rows = jnp.where(t < offsets[-1], jnp.clip(ends[grp] - row0, 0, block_m), 0)
    return jnp.stack([grp, row0, rows], axis=1).astype(jnp.int32)


# Four code bytes and their four scale bytes (pack=4: one 32-bit register each) -> four bf16 weights
# of one nibble ($0, $1: two a register). A byte goes to the high byte of a 16-bit half (prmt),
# where the nibble's sign is one shift from bf16's sign bit and its 3 magnitude bits are one shift
# from the bf16 exponent's two lowest bits and the mantissa's top: the bf16 pattern of the E2M1
# value times 2^-126, the code 0.5 a subnormal. A bf16x2 FMA by 2^126 (subnormal inputs are kept)
# makes it the value, a second one by the scale 2^(s-127) (the scale byte shifted into a bf16
# exponent) scales it; both are exact. One sequence per nibble: Pallas lowers an inline-asm op
# with two results wrongly (jax 0.11.2: "2 outvars do not match 1 outvals").
_DEQUANT_PTX = """{{
.reg .b32 c01, c23, s01, s23, t, two126, neg0;
mov.b32 two126, 0x7E807E80;
mov.b32 neg0, 0x80008000;
prmt.b32 c01, $2, 0, 0x1404;
prmt.b32 c23, $2, 0, 0x3424;
prmt.b32 s01, $3, 0, 0x1404;
prmt.b32 s23, $3, 0, 0x3424;
shr.b32 s01, s01, 1;
shr.b32 s23, s23, 1;
{sign}.b32 $0, c01, {sign_shift};
and.b32 $0, $0, 0x80008000;
shr.b32 t, c01, {magnitude_shift};
and.b32 t, t, 0x01C001C0;
or.b32 $0, $0, t;
{sign}.b32 $1, c23, {sign_shift};
and.b32 $1, $1, 0x80008000;
shr.b32 t, c23, {magnitude_shift};
and.b32 t, t, 0x01C001C0;
or.b32 $1, $1, t;
fma.rn.bf16x2 $0, $0, two126, neg0;
fma.rn.bf16x2 $1, $1, two126, neg0;
fma.rn.bf16x2 $0, $0, s01, neg0;
fma.rn.bf16x2 $1, $1, s23, neg0;
}}"""
# the low nibble sits at bits 11..8 of its half (sign 4 below bf16's, magnitude 2 above its place),
# the high nibble at bits 15..12 (the sign in place, the magnitude 6 above)
_DEQUANT_LO = _DEQUANT_PTX.format(sign="shl", sign_shift=4, magnitude_shift=2)
_DEQUANT_HI = _DEQUANT_PTX.format(sign="shr", sign_shift=0, magnitude_shift=6)


def dequantize_tile(codes, scales, *, interpret: bool = False):
    """uint8 code bytes and their scale bytes (same shape) -> (low-nibble, high-nibble) weights in bf16.

    Exact (as reference.mxfp4.dequantize) for scale bytes 1..254; the scale byte 0 (2^-127) gives
    zeros. On the GPU inline PTX (`_DEQUANT_PTX`, four bytes a sequence); the interpreter takes the
    fp16 route of the FMA path (XLA:CPU flushes the subnormals the PTX relies on, and so also the
    code 0.5 under the scale byte 1, 2^-127: zero there).
    """
    if interpret:
        scale, c = _scale_f32(scales), codes.astype(jnp.int32)
        # the value first (exact), then the scale: 2^14 * 2^(s-127) would overflow for s > 240
        return tuple((_e2m1_to_f32(nib) * FP16_SHIFT * scale).astype(jnp.bfloat16) for nib in (c & 15, c >> 4))
    out = jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)
    return tuple(pltriton.elementwise_inline_asm(asm, args=[codes, scales], pack=4, constraints="=r,=r,r,r",
                                                 result_shape_dtypes=[out])[0]
                 for asm in (_DEQUANT_LO, _DEQUANT_HI))


def _load_step(x_ref, codes_ref, scales_ref, kk, live, *, grp, row0, r, c, row_ok, col_ok, k: int, bk: int):
    """K step kk's code bytes and scale bytes [bk/2, bn] (uint8; each scale byte read for its 16 code
    rows) and x's even / odd columns [bm, bk/2]; nothing is read where `live` is false.

    Rows and columns are gathered (pointer tensors), so a run may start at any row of lhs. Code rows
    past K/2 (the last step of a block_k that does not divide K) read as zeros.
    """
    j = kk * (bk // 2) + jnp.arange(bk // 2, dtype=jnp.int32)
    k_ok = (j < k // 2) & live
    w_mask = k_ok[:, None] & col_ok[None, :]
    codes = pltriton.load(codes_ref.at[(grp * (k // 2) + j)[:, None], c[None, :]], mask=w_mask, other=0)
    sc = pltriton.load(scales_ref.at[(grp * (k // 32) + j // 16)[:, None], c[None, :]], mask=w_mask, other=127)
    xr, x_mask = (row0 + r)[:, None], row_ok[:, None] & k_ok[None, :]
    x_e = pltriton.load(x_ref.at[xr, (2 * j)[None, :]], mask=x_mask, other=0.0)
    x_o = pltriton.load(x_ref.at[xr, (2 * j + 1)[None, :]], mask=x_mask, other=0.0)
    return codes, sc, x_e, x_o


def _steps(load, step, lo, hi, acc, *, ahead: int):
    """acc after step(load(kk), acc) for kk in [lo, hi), each step's loads issued `ahead` steps early.

    The loaded tiles ride in the loop carry, so a step's reads are in flight during the steps
    before it (Triton does not pipeline these loads itself: they feed the dequantisation, not a
    dot). Loads past `hi` are masked off.
    """
    pending = tuple(load(lo + d, lo + d < hi) for d in range(ahead))

    def body(kk, carry):
        acc, pending = carry
        if not ahead:
            return step(load(kk, True), acc), ()
        nxt = load(kk + ahead, kk + ahead < hi)
        return step(pending[0], acc), pending[1:] + (nxt,)
    return lax.fori_loop(lo, hi, body, (acc, pending))[0]


def _scale_f32(scale_bytes):
    """E8M0 scale bytes -> 2^(s-127) in fp32, exact (the byte 0 gives 0)."""
    return lax.bitcast_convert_type(scale_bytes.astype(jnp.int32) << 23, jnp.float32)


def _e2m1_to_f32(nibble):
    """int32 E2M1 codes (0..15) -> fp32 values times 2^-14, via the fp16 bit pattern s000 00em 0000 0000
    (the subnormal 0.5 included: fp16 -> fp32 conversion is exact)."""
    bits = ((nibble & 7) << 9) | ((nibble & 8) << 12)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def _step_fma(tiles, acc):
    """acc [bm, bk/2, bn] + one K step on the FMA units (block_m < 16: a tensor-core dot would be at
    least 16 rows): each row's products stay per code row until the end, so no step reduces across
    threads or converts a tile to a dot operand's layout."""
    codes, sc, x_e, x_o = tiles
    codes, scale = codes.astype(jnp.int32), _scale_f32(sc)
    w_lo, w_hi = _e2m1_to_f32(codes & 15) * scale, _e2m1_to_f32(codes >> 4) * scale
    x_e, x_o = x_e.astype(jnp.float32), x_o.astype(jnp.float32)
    return acc + x_e[:, :, None] * w_lo[None] + x_o[:, :, None] * w_hi[None]


def _step(tiles, acc, *, interpret: bool):
    """acc + one K step: dequantise [bk/2, bn] code bytes, two dots."""
    codes, sc, x_e, x_o = tiles
    w_lo, w_hi = dequantize_tile(codes, sc, interpret=interpret)
    acc += jnp.dot(x_e, w_lo, preferred_element_type=jnp.float32)
    return acc + jnp.dot(x_o, w_hi, preferred_element_type=jnp.float32)


def _kernel(table_ref, x_ref, codes_ref, scales_ref, out_ref, *, cfg: Mxfp4Config, m: int, k: int, n: int,
            num_groups: int, steps_per_split: int):
    """One (table entry, N tile, K split): acc[bm, bn] = x rows @ dequantised expert columns."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    t, ni, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    grp, row0, rows = table_ref[t, 0], table_ref[t, 1], table_ref[t, 2]
    r = jnp.arange(bm, dtype=jnp.int32)
    c = ni * bn + jnp.arange(bn, dtype=jnp.int32)
    row_ok, col_ok = r < rows, c < n
    out_rows = s * m + row0 + r  # split partials stacked [splits * M, N]
    out_mask = row_ok[:, None] & col_ok[None, :]

    @pl.when((grp == num_groups) & (rows > 0))  # rows past sum(group_sizes)
    def _():
        pltriton.store(out_ref.at[out_rows[:, None], c[None, :]], jnp.zeros((bm, bn), out_ref.dtype),
                       mask=out_mask)

    @pl.when((grp < num_groups) & (rows > 0))
    def _():
        load = functools.partial(_load_step, x_ref, codes_ref, scales_ref, grp=grp, row0=row0, r=r, c=c,
                                 row_ok=row_ok, col_ok=col_ok, k=k, bk=bk)
        lo = s * steps_per_split
        hi = jnp.minimum(lo + steps_per_split, -(-k // bk))
        if bm < 16:  # FMA units, products summed over the code rows at the end
            acc = _steps(load, _step_fma, lo, hi, jnp.zeros((bm, bk // 2, bn), jnp.float32), ahead=cfg.ahead)
            acc = acc.sum(axis=1) * FP16_SHIFT
        else:
            step = functools.partial(_step, interpret=cfg.interpret)
            acc = _steps(load, step, lo, hi, jnp.zeros((bm, bn), jnp.float32), ahead=cfg.ahead)
        pltriton.store(out_ref.at[out_rows[:, None], c[None, :]], acc.astype(out_ref.dtype), mask=out_mask)


def _pair_table(experts):
    """int32 [R, 3]: row r of lhs is one run of one row of group experts[r] (the unsorted pairs of decode)."""
    r = experts.shape[0]
    return jnp.stack([experts.astype(jnp.int32), jnp.arange(r, dtype=jnp.int32), jnp.ones((r,), jnp.int32)], 1)


def _run(lhs, rhs: ref.MXFP4, table, cfg: Mxfp4Config, out_dtype):
    """out [M, N] in out_dtype over the runs of `table` (fp32 partials summed when the K range is split)."""
    m, k = lhs.shape
    g, _, n = rhs.shape
    steps = -(-k // cfg.block_k)
    per = -(-steps // cfg.splits)
    splits = -(-steps // per)  # no empty splits
    cfg = dataclasses.replace(cfg, splits=splits)
    part_dtype = out_dtype if splits == 1 else jnp.float32
    body = functools.partial(_kernel, cfg=cfg, m=m, k=k, n=n, num_groups=g, steps_per_split=per)
    codes, scales = rhs.codes.reshape(g * k // 2, n), rhs.scales.reshape(g * k // 32, n)
    table, lhs, codes, scales = common(table, lhs, codes, scales)  # inside shard_map: one varying set
    out = pl.pallas_call(
        body,
        out_shape=out_struct((splits * m, n), part_dtype, lhs),
        grid=(table.shape[0], -(-n // cfg.block_n), splits),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="mxfp4_ragged_dot",
    )(table, lhs, codes, scales)
    if splits == 1:
        return out
    return out.reshape(splits, m, n).sum(axis=0).astype(out_dtype)


def _ragged(lhs, rhs: ref.MXFP4, group_sizes, cfg: Mxfp4Config, out_dtype):
    return _run(lhs, rhs, _tile_table(group_sizes, lhs.shape[0], cfg.block_m), cfg, out_dtype)


# ----------------------------------------------------------------------------- matrix-vector form for pairs

@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """`pair_dot` as matrix-vector products on the FMA units: one program per (pair, block_n columns, K split).

    A K step is `groups` scale groups (16 code rows each). layout "rows": each code row is one vector of
    block_n bytes, the products of a group summed per column, then scaled once by the group's scale row;
    "tile": [groups, 16, block_n] tiles with the scale row broadcast over its 16 code rows, partial sums
    kept per code row and reduced after the last step; "tile_reduce": as "tile", the 16 rows reduced
    every step. dequant "e4m3": inline PTX makes four bytes' nibbles E4M3 bytes, converted two an
    instruction (`_E4M3_PTX`; compute capability 8.9+); "pair": inline PTX turns a code byte into its
    two values as one fp16 pair (`_PAIR_PTX`); "f16": that pair's bits from jnp ops. The interpreter
    takes jnp ops for all three. splits=0: enough K splits for ~`programs` programs. Split partials
    are fp32, summed outside the kernel in a fixed order (deterministic). `pair_config` gives the
    measured default (module docstring).
    """
    block_n: int = 256
    groups: int = 1
    splits: int = 0
    num_warps: int = 2
    num_stages: int = 1
    ahead: int = 1
    layout: str = "rows"
    dequant: str = "e4m3"
    programs: int = 528  # splits=0: K splits until about this many programs (4 an SM of an H100 / H200)
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
        if self.layout not in ("rows", "tile", "tile_reduce"):
            raise ValueError(f"layout {self.layout!r} is not one of rows, tile, tile_reduce")
        if self.dequant not in ("e4m3", "pair", "f16"):
            raise ValueError(f"dequant {self.dequant!r} is not one of e4m3, pair, f16")


# Four code bytes (one register) -> the four values of one nibble in fp32, times 2^-6. A nibble
# s e1 e0 m placed in a byte as s 0 0 e1 e0 m 0 0 is the E4M3 pattern of its E2M1 value times 2^-6
# (the code 0.5 an E4M3 subnormal), so all four bytes are placed with two masks and a shift, and
# Hopper's cvt.rn.f16x2.e4m3x2 (two values an instruction) and cvt.f32.f16 make them fp32, exact.
# One sequence per nibble: Pallas lowers an inline-asm op with two results wrongly (see _DEQUANT_PTX).
_E4M3_PTX = """{{
.reg .b32 m, s, q;
.reg .b16 p0, p1, a0, a1, a2, a3;
.reg .b32 h01, h23;
.reg .f32 f0, f1, f2, f3;
{place}
or.b32 q, m, s;
mov.b32 {{p0, p1}}, q;
cvt.rn.f16x2.e4m3x2 h01, p0;
cvt.rn.f16x2.e4m3x2 h23, p1;
mov.b32 {{a0, a1}}, h01;
mov.b32 {{a2, a3}}, h23;
cvt.f32.f16 f0, a0;
cvt.f32.f16 f1, a1;
cvt.f32.f16 f2, a2;
cvt.f32.f16 f3, a3;
mov.b32 $0, f0;
mov.b32 $1, f1;
mov.b32 $2, f2;
mov.b32 $3, f3;
}}"""
# low nibble: magnitude bits 0-2 -> 2-4, sign bit 3 -> 7; high nibble: magnitude 4-6 -> 2-4, sign in place
_E4M3_LO = _E4M3_PTX.format(place="""and.b32 m, $4, 0x07070707;
shl.b32 m, m, 2;
and.b32 s, $4, 0x08080808;
shl.b32 s, s, 4;""")
_E4M3_HI = _E4M3_PTX.format(place="""shr.b32 m, $4, 2;
and.b32 m, m, 0x1C1C1C1C;
and.b32 s, $4, 0x80808080;""")
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


def _halves_f32(w):
    """int32 fp16 pairs -> (low half, high half) in fp32 (exact)."""
    f = lambda h: lax.bitcast_convert_type(h.astype(jnp.uint16), jnp.float16).astype(jnp.float32)
    return f(w & 0xFFFF), f(w >> 16)


def nibbles_e4m3(codes, *, ptx: bool):
    """uint8 code bytes -> (low-nibble, high-nibble) values times 2^-6 in fp32 (`_E4M3_PTX`; off the GPU
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
    return _halves_f32(pair_halves(codes, ptx=cfg.dequant == "pair" and not cfg.interpret))


def _nibble_shift(cfg: GemvConfig) -> float:
    return E4M3_SHIFT if cfg.dequant == "e4m3" else FP16_SHIFT


def _x_pair(words):
    """uint32 words holding lhs's (even, odd) bf16 pair -> the two in fp32 (exact)."""
    return (lax.bitcast_convert_type(words << 16, jnp.float32),
            lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32))


def _gemv_kernel(ex_ref, xw_ref, codes_ref, scales_ref, out_ref, *, cfg: GemvConfig, rows: int, k: int,
                 n: int, steps_per_split: int):
    """One (pair, N tile, K split): out[r, tile] = lhs[r, K range] @ dequantised expert columns (flat refs).

    Each scale row is read once for its 16 code rows; K is walked a step of `groups` scale groups at a
    time, each step's loads issued `ahead` steps early (`_steps`).
    """
    bn, gq = cfg.block_n, cfg.groups
    r, ni, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = ex_ref[r]
    c = ni * bn + jnp.arange(bn, dtype=jnp.int32)
    col_ok = c < n
    kh = k // 2
    code_base, scale_base, x_base = e * kh, e * (k // 32), r * kh
    steps = -(-k // (32 * gq))
    lo = s * steps_per_split
    hi = jnp.minimum(lo + steps_per_split, steps)

    if cfg.layout == "rows":
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

        def step(tiles, acc):
            codes, xs, scs = tiles
            for q in range(gq):
                part = jnp.zeros((bn,), jnp.float32)
                for i in range(16 * q, 16 * (q + 1)):
                    w_lo, w_hi = _nibbles_f32(codes[i], cfg)
                    x_e, x_o = _x_pair(xs[i])
                    part = part + x_e * w_lo + x_o * w_hi
                acc = acc + _scale_f32(scs[q]) * part
            return acc
        acc = _steps(load, step, lo, hi, jnp.zeros((bn,), jnp.float32), ahead=cfg.ahead)
    else:
        gi = jnp.arange(gq, dtype=jnp.int32)[:, None, None]
        ii = jnp.arange(16, dtype=jnp.int32)[None, :, None]
        cc, cok = c[None, None, :], col_ok[None, None, :]

        def load(kk, live):
            j = kk * (16 * gq) + gi * 16 + ii  # [gq, 16, 1] code rows
            ok = live & (j < kh)
            codes = pltriton.load(codes_ref.at[(code_base + j) * n + cc], mask=ok & cok, other=0)
            xs = pltriton.load(xw_ref.at[x_base + jnp.minimum(j, kh - 1)], mask=ok, other=0)
            g = kk * gq + gi  # [gq, 1, 1]
            sc = pltriton.load(scales_ref.at[(scale_base + g) * n + cc], mask=live & (g < k // 32) & cok, other=0)
            return codes, xs, sc

        def step(tiles, acc):
            codes, xs, sc = tiles
            w_lo, w_hi = _nibbles_f32(codes, cfg)
            x_e, x_o = _x_pair(xs)
            part = x_e * w_lo + x_o * w_hi  # [gq, 16, bn]
            if cfg.layout == "tile":
                return acc + _scale_f32(sc) * part
            return acc + _scale_f32(sc[:, 0, :]) * part.sum(axis=1)
        shape = (gq, 16, bn) if cfg.layout == "tile" else (gq, bn)
        acc = _steps(load, step, lo, hi, jnp.zeros(shape, jnp.float32), ahead=cfg.ahead)
        acc = acc.sum(axis=0)
        if cfg.layout == "tile":
            acc = acc.sum(axis=0)
    out = (acc * _nibble_shift(cfg)).astype(out_ref.dtype)
    pltriton.store(out_ref.at[(s * rows + r) * n + c], out, mask=col_ok)


def gemv_splits(r: int, k: int, n: int, cfg: GemvConfig) -> int:
    """K splits: cfg.splits, or (0) enough for ~cfg.programs programs, at most one per K step."""
    steps = -(-k // (32 * cfg.groups))
    want = cfg.splits or -(-cfg.programs // (r * -(-n // cfg.block_n)))
    per = -(-steps // max(1, min(want, steps)))
    return -(-steps // per)  # no empty splits


def _gemv(lhs, rhs: ref.MXFP4, experts, cfg: GemvConfig, out_dtype):
    """out [R, N] = lhs[r] @ dequantise(rhs[experts[r]]) by `_gemv_kernel` (fp32 split partials summed)."""
    r, k = lhs.shape
    g, _, n = rhs.shape
    splits = gemv_splits(r, k, n, cfg)
    steps = -(-k // (32 * cfg.groups))
    per = -(-steps // splits)
    part_dtype = out_dtype if splits == 1 else jnp.float32
    body = functools.partial(_gemv_kernel, cfg=cfg, rows=r, k=k, n=n, steps_per_split=per)
    xw = lax.bitcast_convert_type(lhs.reshape(r, k // 2, 2), jnp.uint32).reshape(-1)  # (even, odd) bf16 pairs
    codes, scales = rhs.codes.reshape(-1), rhs.scales.reshape(-1)
    experts, xw, codes, scales = common(experts, xw, codes, scales)
    out = pl.pallas_call(
        body,
        out_shape=out_struct((splits * r * n,), part_dtype, xw),
        grid=(r, -(-n // cfg.block_n), splits),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="mxfp4_pair_gemv",
    )(experts, xw, codes, scales)
    if splits == 1:
        return out.reshape(r, n)
    return out.reshape(splits, r, n).sum(axis=0).astype(out_dtype)


# ----------------------------------------------------------------------------- public ops


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _mxfp4_dot(lhs, rhs, group_sizes, cfg, out_dtype):
    return _ragged(lhs, rhs, group_sizes, cfg, out_dtype)


def _mxfp4_dot_fwd(lhs, rhs, group_sizes, cfg, out_dtype):
    return _ragged(lhs, rhs, group_sizes, cfg, out_dtype), (lhs, rhs, group_sizes)


def _mxfp4_dot_bwd(cfg, out_dtype, res, dout):
    """d lhs = dout @ W^T per group (the reference, on dequantised weights); packed weights get none."""
    lhs, rhs, group_sizes = res
    w_t = jnp.swapaxes(ref.dequantize(rhs, lhs.dtype), 1, 2)  # [G, N, K]
    dlhs = lax.ragged_dot(dout.astype(lhs.dtype), w_t, group_sizes, preferred_element_type=jnp.float32)
    return dlhs.astype(lhs.dtype), None, None


_mxfp4_dot.defvjp(_mxfp4_dot_fwd, _mxfp4_dot_bwd)


def ragged_dot(lhs, rhs: ref.MXFP4, group_sizes, *, preferred_element_type=None,
               config: Mxfp4Config | None = None):
    """`reference.mxfp4.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])` dequantising in registers.

    fp32 accumulation; the result in preferred_element_type (default lhs's dtype).
    """
    m, k = lhs.shape
    g, _, n = rhs.shape
    cfg = config or default_config(m, k, n, g)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    return _mxfp4_dot(lhs, rhs, group_sizes.astype(jnp.int32), cfg, out_dtype)


def matmul(x, w: ref.MXFP4, *, config: Mxfp4Config | None = None):
    """x [..., K] @ W [K, N] (one packed matrix) -> [..., N]: the grouped kernel with one group."""
    k, n = w.shape
    x2 = x.reshape(-1, k)
    rhs = ref.MXFP4(w.codes[None], w.scales[None])
    cfg = config or default_config(x2.shape[0], k, n, 1)
    out = ragged_dot(x2, rhs, jnp.full((1,), x2.shape[0], jnp.int32), config=cfg)
    return out.reshape(x.shape[:-1] + (n,))


def _pairs(lhs, rhs, experts, cfg, out_dtype):
    if isinstance(cfg, GemvConfig):
        return _gemv(lhs, rhs, experts, cfg, out_dtype)
    return _run(lhs, rhs, _pair_table(experts), cfg, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _pairs_dot(lhs, rhs, experts, cfg, out_dtype):
    return _pairs(lhs, rhs, experts, cfg, out_dtype)


def _pairs_dot_fwd(lhs, rhs, experts, cfg, out_dtype):
    return _pairs(lhs, rhs, experts, cfg, out_dtype), (lhs, rhs, experts)


def _pairs_dot_bwd(cfg, out_dtype, res, dout):
    """d lhs[r] = dout[r] @ W[experts[r]]^T (the reference); packed weights and indices get none."""
    lhs, rhs, experts = res
    _, vjp = jax.vjp(lambda x: ref.pair_dot(x, rhs, experts, preferred_element_type=jnp.float32), lhs)
    return vjp(dout.astype(jnp.float32))[0].astype(lhs.dtype), None, None


_pairs_dot.defvjp(_pairs_dot_fwd, _pairs_dot_bwd)


def pair_config(r: int, k: int, n: int, *, interpret: bool = False) -> Mxfp4Config | GemvConfig:
    """`pair_dot`'s default: the matrix-vector kernel, 1024 columns a program over 4 warps (8 code bytes a
    thread a row), loads one K step ahead, K split for ~4 programs an SM; the fp16-pair conversion below
    compute capability 8.9. It beat the grouped kernel at every R, G and shape measured (module
    docstring). The grouped kernel stays reachable with config=default_config(r, k, n, r)."""
    del r, k, n  # the K splits follow R and N in gemv_splits
    cc = _capability()
    dequant = "pair" if cc is not None and cc < (8, 9) else "e4m3"  # cvt from E4M3 needs sm_89
    return GemvConfig(block_n=1024, num_warps=4, dequant=dequant, interpret=interpret)


def pair_dot(lhs, rhs: ref.MXFP4, experts, *, preferred_element_type=None,
             config: Mxfp4Config | GemvConfig | None = None):
    """`reference.mxfp4.pair_dot(lhs [R, K], rhs [G, K, N], experts [R])`: row r times expert experts[r].

    No sort and no tile table to build: by default (`pair_config`) the matrix-vector kernel, one program
    per (pair, column tile, K split); an Mxfp4Config runs the grouped kernel with each row its own run.
    fp32 accumulation; the result in preferred_element_type (default lhs's dtype).
    """
    r, k = lhs.shape
    g, _, n = rhs.shape
    cfg = config or pair_config(r, k, n)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    return _pairs_dot(lhs, rhs, experts.astype(jnp.int32), cfg, out_dtype)


def supported_pairs(lhs, rhs, experts, config: Mxfp4Config | GemvConfig | None = None) -> bool:
    """As `supported`, for `pair_dot`: experts int [R] with R the rows of lhs."""
    if experts.ndim != 1 or not jnp.issubdtype(experts.dtype, jnp.integer) or experts.shape[0] != lhs.shape[0]:
        return False
    sizes = jax.ShapeDtypeStruct((rhs.shape[0],), jnp.int32)  # what `supported` checks of group sizes
    return isinstance(rhs, ref.MXFP4) and supported(lhs, rhs, sizes, config)


def ragged_dot_reference(lhs, rhs: ref.MXFP4, group_sizes):
    """The semantics: dequantise, then jax.lax.ragged_dot with fp32 accumulation, lhs's dtype out."""
    return ref.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)
