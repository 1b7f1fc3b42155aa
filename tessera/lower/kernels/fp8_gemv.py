"""Block-scaled fp8 weights times one token, on the FMA units (Pallas, Triton backend).

`reference.fp8_blocks.weight_only_einsum` for batch-1 decode: einsum(spec, x, W) with W held as `FP8Blocks`
(one e4m3 byte a weight, one fp32 scale per B×B block of its last two dims), reading each code byte once. The
product is seen as a matrix-vector product out[n] = Σ_k x[k] · codes[k, n] · scale(k, n) over W's 2-D view
[K, N] (W's contracted dims first, in W's order, then its kept dims), which covers the attention projections:

  q/k/v [d, heads, head_dim] ("bse,ehd->bshd"): K = d, the block dims kept; a row's scales are
    scales[k, (h // B) · (head_dim / B) + hd // B] — one per row when B covers both (folded into x).
  o [heads, head_dim, d] ("bshd,hde->bse"): K = heads · head_dim, N = d; scale(k, n) = scales[k // B, n // B].

One program per (block_n columns, K split) walks its K range `rows` code rows a step: each row one vector of
block_n bytes, converted four at a time with Hopper's cvt.rn.f16x2.e4m3x2 (`_E4M3_PTX`, exact: every e4m3
value is an fp16 one), times x[k] in fp32 and summed per column; a step's scale row (one per B rows) scales
its sum once. Split-K partials are fp32, summed outside in a fixed order (deterministic).

Numerics: the products are of the exact dequantised values codes · scale in fp32; the reference rounds each
weight to the compute dtype first (`dequantize(w, compute_dtype)`), so the two differ by that rounding (the
tests bound it), not by the accumulation, which is fp32 in both.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tessera.lower.kernels._vma import common, out_struct
from tessera.lower.kernels.mxfp4_matmul import _capability, _steps
from tessera.lower.reference.fp8_blocks import FP8Blocks


@dataclasses.dataclass(frozen=True)
class Fp8GemvConfig:
    """One program per (block_n columns, K split); a K step is `rows` code rows, its loads issued `ahead` steps
    early. splits=0: enough K splits for about `programs` programs."""
    block_n: int = 1024
    rows: int = 8
    splits: int = 0
    num_warps: int = 4
    num_stages: int = 1
    ahead: int = 1
    programs: int = 528  # 4 an SM of an H100 / H200
    interpret: bool = False

    def __post_init__(self):
        for name in ("block_n", "rows"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two (Triton tiles)")
        if self.block_n < 32 or self.splits < 0 or self.ahead < 0:
            raise ValueError(f"block_n ({self.block_n}) must be >= 32, splits ({self.splits}) and ahead "
                             f"({self.ahead}) >= 0")


@dataclasses.dataclass(frozen=True)
class Layout:
    """W's 2-D view: K rows (contracted), N columns (kept); scale(k, n) = scales[(k // row_block) · row_stride +
    colmap(n)] with colmap(n) = ((n // n_inner) // block) · (n_inner // block) + (n % n_inner) // block.
    `fold`: one scale a row (row_block 1, row_stride 1), multiplied into x instead."""
    k: int
    n: int
    block: int
    row_block: int  # 1 (a scale row per code row) or block (one per block of code rows)
    row_stride: int  # scale entries per scale row
    n_inner: int  # the size of W's last dim (the columns' fastest dim)
    fold: bool


def layout(spec: str, x_shape, w: FP8Blocks) -> Layout | str:
    """W's 2-D view for `spec`, or why the kernel does not take it."""
    a, b, o = spec.replace(" ", "").replace("->", ",").split(",")
    contracted = [c for c in b if c in a and c not in o]
    if not contracted or b[:len(contracted)] != "".join(contracted):
        return "the contracted dims are not W's leading dims"
    if any(c not in b and x_shape[a.index(c)] != 1 for c in a if c in o):
        return "more than one token"
    shape, blk = w.shape, w.block
    nc, lead = len(contracted), len(shape) - 2
    k = math.prod(shape[:nc])
    n = math.prod(shape[nc:])
    kb, nb = shape[-2] // blk, shape[-1] // blk
    if nc == lead:  # contract the leading dims, keep the two block dims: a scale row per code row
        return Layout(k, n, blk, 1, kb * nb, shape[-1], fold=kb * nb == 1)
    if nc == lead + 1:  # contract the leading dims and the first block dim: a scale row per `blk` code rows
        return Layout(k, n, blk, blk, nb, shape[-1], fold=False)
    return "W's view keeps more than its two block dims"


def supported(spec: str, x, w, *, compute_dtype=None, out_dtype=None, config: Fp8GemvConfig | None = None):
    """True when the kernel takes einsum(spec, x, W) (one token, fp8 codes, a layout it reads), else why not."""
    del compute_dtype, out_dtype
    cfg = config or Fp8GemvConfig()
    if not isinstance(w, FP8Blocks) or w.codes.dtype != jnp.float8_e4m3fn:
        return False
    if not cfg.interpret:
        cc = _capability()
        if cc is None or cc < (8, 9):
            return "no GPU of compute capability 8.9+ (cvt from e4m3)"
    lay = layout(spec, x.shape, w)
    if isinstance(lay, str):
        return lay
    if lay.row_block > 1 and lay.row_block % cfg.rows:
        return f"{cfg.rows} rows a step do not divide the {lay.row_block}-row scale blocks"
    return True


# Four e4m3 code bytes (one register) -> their four values in fp32: Hopper's cvt.rn.f16x2.e4m3x2 makes two
# fp16 values an instruction (exact: e4m3 is a subset of fp16), then cvt.f32.f16. One result a value: Pallas
# lowers an inline-asm op with several outputs only as one (see mxfp4_gemv).
def e4m3_ptx(src: str = "$4", *, prelude: str = "", regs: str = "") -> str:
    """The PTX taking the four e4m3 bytes of register `src` to $0-$3 in fp32; `prelude` (declaring `regs`)
    computes `src` first (mxfp4_gemv places E2M1 nibbles as e4m3 bytes)."""
    lines = ["{", *([regs] if regs else []), ".reg .b16 p0, p1, a0, a1, a2, a3;", ".reg .b32 h01, h23;",
             ".reg .f32 f0, f1, f2, f3;", *([prelude] if prelude else []), f"mov.b32 {{p0, p1}}, {src};",
             "cvt.rn.f16x2.e4m3x2 h01, p0;", "cvt.rn.f16x2.e4m3x2 h23, p1;", "mov.b32 {a0, a1}, h01;",
             "mov.b32 {a2, a3}, h23;", *(f"cvt.f32.f16 f{i}, a{i};" for i in range(4)),
             *(f"mov.b32 ${i}, f{i};" for i in range(4)), "}"]
    return "\n".join(lines)


_E4M3_PTX = e4m3_ptx()


def e4m3_f32(codes, *, ptx: bool):
    """uint8 e4m3 code bytes -> their values in fp32 (`_E4M3_PTX`; off the GPU the same values from jnp ops)."""
    if ptx:
        out = jax.ShapeDtypeStruct(codes.shape, jnp.int32)
        bits = pltriton.elementwise_inline_asm(_E4M3_PTX, args=[codes], pack=4, constraints="=r,=r,=r,=r,r",
                                               result_shape_dtypes=[out])[0]
        return lax.bitcast_convert_type(bits, jnp.float32)
    return lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)


def _kernel(x_ref, codes_ref, scales_ref, out_ref, *, cfg: Fp8GemvConfig, lay: Layout, steps_per_split: int):
    """One (N tile, K split): out[split, tile] = Σ over the split's rows of x[k] · codes[k, tile] · scale."""
    bn, rows, k, n = cfg.block_n, cfg.rows, lay.k, lay.n
    ni, s = pl.program_id(0), pl.program_id(1)
    c = ni * bn + jnp.arange(bn, dtype=jnp.int32)
    col_ok = c < n
    cs = jnp.minimum(c, n - 1)
    colmap = ((cs // lay.n_inner) // lay.block) * (lay.n_inner // lay.block) + (cs % lay.n_inner) // lay.block
    per_row = not lay.fold and lay.row_block == 1  # a scale row for every code row
    lo = s * steps_per_split
    hi = jnp.minimum(lo + steps_per_split, -(-k // rows))

    def scale_row(r, ok):
        return pltriton.load(scales_ref.at[(r // lay.row_block) * lay.row_stride + colmap], mask=col_ok & ok,
                             other=0.0)

    def load(kk, live):
        codes, xs, scs = [], [], []
        for i in range(rows):
            j = kk * rows + i
            ok = live & (j < k)
            codes.append(pltriton.load(codes_ref.at[jnp.minimum(j, k - 1) * n + c], mask=col_ok & ok, other=0))
            xj = x_ref[jnp.minimum(j, k - 1)].astype(jnp.float32)
            if lay.fold:  # the row's one scale, applied to x[k] (exact products of codes, as the others)
                xj = xj * scales_ref[jnp.minimum(j, k - 1)]
            xs.append(jnp.where(ok, xj, 0.0))
            if per_row:
                scs.append(scale_row(jnp.minimum(j, k - 1), ok))
        if not lay.fold and not per_row:  # the step's rows share one scale row (rows divides row_block)
            scs.append(scale_row(jnp.minimum(kk * rows, k - 1), live & (kk * rows < k)))
        return tuple(codes), tuple(xs), tuple(scs)

    def step(tiles, acc):
        codes, xs, scs = tiles
        part = jnp.zeros((bn,), jnp.float32)
        for i in range(rows):
            w = e4m3_f32(codes[i], ptx=not cfg.interpret)
            part = part + (xs[i] * w * scs[i] if per_row else xs[i] * w)
        return acc + (part if lay.fold or per_row else part * scs[0])

    acc = _steps(load, step, lo, hi, jnp.zeros((bn,), jnp.float32), ahead=cfg.ahead)
    pltriton.store(out_ref.at[s * n + c], acc, mask=col_ok)


def splits_for(lay: Layout, cfg: Fp8GemvConfig) -> int:
    """K splits: cfg.splits, or enough for ~cfg.programs programs, at most one a K step (no empty splits)."""
    steps = -(-lay.k // cfg.rows)
    want = cfg.splits or -(-cfg.programs // -(-lay.n // cfg.block_n))
    per = -(-steps // max(1, min(want, steps)))
    return -(-steps // per)


def weight_only_einsum(spec: str, x, w: FP8Blocks, *, compute_dtype=None, out_dtype, config=None):
    """`reference.fp8_blocks.weight_only_einsum` by `_kernel` (check `supported` first). Forward only."""
    del compute_dtype  # the kernel multiplies the exact fp32 dequantised values (module docstring)
    cfg = config or Fp8GemvConfig()
    lay = layout(spec, x.shape, w)
    if isinstance(lay, str):
        raise ValueError(f"fp8_gemv: {lay} ({spec!r}, W {list(w.shape)})")
    a, b, o = spec.replace(" ", "").replace("->", ",").split(",")
    contracted = [c for c in b if c in a and c not in o]
    # x in W's row order (a reshape where x's contracted dims are in W's order), converted and scaled in the
    # kernel: as separate XLA ops they were two more launches a call (2.5 of the q projection's 10.6 us)
    xk = jnp.einsum(f"{a}->{''.join(contracted)}", x).reshape(lay.k)
    scales = w.scales.reshape(-1)
    codes = lax.bitcast_convert_type(w.codes, jnp.uint8).reshape(-1)
    splits = splits_for(lay, cfg)
    per = -(-(-(-lay.k // cfg.rows)) // splits)
    xk, codes, scales = common(xk, codes, scales)
    out = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, lay=lay, steps_per_split=per),
        out_shape=out_struct((splits * lay.n,), jnp.float32, codes),
        grid=(-(-lay.n // cfg.block_n), splits),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="fp8_block_gemv",
    )(xk, codes, scales)
    # the split-K sum in a reduce of its own, as mxfp4_gemv's (fused into its consumer XLA runs it strided)
    y = lax.optimization_barrier(out.reshape(splits, lay.n).sum(axis=0).astype(out_dtype))
    kept = [c for c in b if c not in contracted]
    tokens = [c for c in a if c not in b]
    y = y.reshape([x.shape[a.index(c)] for c in tokens] + [w.shape[b.index(c)] for c in kept])
    return jnp.einsum(f"{''.join(tokens + kept)}->{o}", y)
