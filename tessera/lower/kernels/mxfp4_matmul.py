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
with no table to build. By default (`mxfp4_gemv.pair_config`) it runs the matrix-vector kernel of
`mxfp4_gemv` on the FMA units (1.3-1.6x faster at decode, numbers there); an Mxfp4Config runs this
module's kernel with each row its own run.

Backend: `pl.pallas_call` lowered through Triton (jax 0.10-0.12; CPU interpreter for CI). Forward only;
the gradient w.r.t. lhs goes through the reference (dequantised weights), packed weights get none.

block_m < 16 takes the products on the FMA units instead (`_step_fma`); at decode it measured no
faster than 16-row dots (docs/kernels-log.md, "MXFP4 expert matmul"), so the defaults keep the dots.

Measured on an H200 (docs/kernels-log.md, "MXFP4 expert matmul"; profile busy time, 2880 -> 2880 unless
said): one token's 4 experts (17.7 MB) in 22.8 us (776 GB/s), 8 tokens in 86 us, 2880 -> 5760 at 4096
rows in 0.88 ms; the E4M3 route converting one nibble at a time took 33.8 / 137 / 1345 us, of which the
inline PTX saved ~15% and issuing each K step's loads one step early (`Mxfp4Config.ahead`) the rest.
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


def supported(lhs, rhs, group_sizes, config=None) -> bool:
    """GPU (or the interpreter: a config with interpret set, Mxfp4Config or GemvConfig), bf16 lhs [M, K],
    packed rhs [G, K, N], int group_sizes [G], K % 32 == 0."""
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
    if isinstance(cfg, Mxfp4Config):  # the grouped kernel, each row its own run
        return _run(lhs, rhs, _pair_table(experts), cfg, out_dtype)
    from tessera.lower.kernels import mxfp4_gemv  # imports this module's helpers

    return mxfp4_gemv.gemv(lhs, rhs, experts, cfg, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _pairs_dot(lhs, rhs, experts, cfg, out_dtype):
    return _pairs(lhs, rhs, experts, cfg, out_dtype)


def _pairs_dot_fwd(lhs, rhs, experts, cfg, out_dtype):
    return _pairs(lhs, rhs, experts, cfg, out_dtype), (lhs, rhs, experts)


def _pairs_dot_bwd(cfg, out_dtype, res, dout):
    """d lhs[r] = dout[r] @ W[experts[r]]^T (the reference; summed over the matrices of a tuple); packed
    weights and indices get none."""
    lhs, rhs, experts = res
    _, vjp = jax.vjp(lambda x: ref.pair_dot(x, rhs, experts, preferred_element_type=jnp.float32), lhs)
    wide = jax.tree.map(lambda d: d.astype(jnp.float32), dout)
    return vjp(wide)[0].astype(lhs.dtype), None, None


_pairs_dot.defvjp(_pairs_dot_fwd, _pairs_dot_bwd)


def pair_dot(lhs, rhs, experts, *, preferred_element_type=None, config=None):
    """`reference.mxfp4.pair_dot(lhs [R, K], rhs [G, K, N], experts [R])`: row r times expert experts[r].

    No sort and no tile table to build: by default (`mxfp4_gemv.pair_config`) the matrix-vector kernel, one
    program per (pair, column tile, K split); a `mxfp4_gemv.GemvConfig` sets its knobs, an Mxfp4Config runs
    the grouped kernel with each row its own run. fp32 accumulation; the result in preferred_element_type
    (default lhs's dtype). `rhs` a tuple of matrices of one shape (an expert's gate and up): a tuple of
    products, from one launch of the matrix-vector kernel.
    """
    from tessera.lower.kernels import mxfp4_gemv  # imports this module's helpers

    r, k = lhs.shape
    g, _, n = (rhs[0] if ref.several(rhs) else rhs).shape
    if ref.several(rhs) and isinstance(config, Mxfp4Config):
        return tuple(pair_dot(lhs, m, experts, preferred_element_type=preferred_element_type, config=config)
                     for m in rhs)
    cfg = config or mxfp4_gemv.pair_config(r, k, n)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    return _pairs_dot(lhs, rhs, experts.astype(jnp.int32), cfg, out_dtype)


def supported_pairs(lhs, rhs, experts, config=None) -> bool:
    """As `supported`, for `pair_dot`: experts int [R] with R the rows of lhs."""
    if experts.ndim != 1 or not jnp.issubdtype(experts.dtype, jnp.integer) or experts.shape[0] != lhs.shape[0]:
        return False
    if ref.several(rhs):  # matrices of one shape, each one the kernel takes
        return bool(rhs) and all(m.shape == rhs[0].shape and supported_pairs(lhs, m, experts, config) for m in rhs)
    sizes = jax.ShapeDtypeStruct((rhs.shape[0],), jnp.int32)  # what `supported` checks of group sizes
    return isinstance(rhs, ref.MXFP4) and supported(lhs, rhs, sizes, config)


def ragged_dot_reference(lhs, rhs: ref.MXFP4, group_sizes):
    """The semantics: dequantise, then jax.lax.ragged_dot with fp32 accumulation, lhs's dtype out."""
    return ref.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)
