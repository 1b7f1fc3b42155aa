"""The MXFP4 matrix-vector kernel's products on the tensor cores: an experiment, measured and not kept.

`tessera/lower/kernels/mxfp4_gemv.py` converts each code byte's two values to fp32 and sums their products with
x on the FMA units, issue-bound at about half the copy bandwidth. This route (session 31) turns a scale group's 16
code rows into two [16, block_n] fp16 operands, one conversion instruction for two values (`_E4M3_F16`), and lets
`tl.dot` multiply them by x scaled into fp16's range (`mma_tile`). Interpreter-exact and bitwise on the PTX
emulator (test_mxfp4_gemv_mma.py); on one H100 (session 32, `python -m bench.mxfp4_gemv --variants ...`, R = 4, G
= 32, worst of the two GPT-OSS shapes against the grouped kernel) the best form, 256 columns over 4 warps with x
on the left, took 0.94x the grouped kernel's time (28.4 us the gate+up kernel, 17.4 us down), where the FMA
default takes about 0.67x (its table in mxfp4_gemv.py, an H200; 20 / 11 us in session 31's H100 profile of the
decode step): about 1.4x slower. The weights on the left ([block_n, 16] tiles): 1.03-1.19x. Not kept.

`MmaConfig` is a `GemvConfig` whose programs `installed()` routes here (it patches `mxfp4_gemv._gemv_tile`):

    with installed():
        mxfp4_matmul.pair_dot(lhs, rhs, experts, config=MmaConfig(block_n=256, num_warps=4))
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

from tessera.lower.kernels import mxfp4_gemv as mg, mxfp4_matmul as mm


@dataclasses.dataclass(frozen=True)
class MmaConfig(mg.GemvConfig):
    """A `GemvConfig` on the tensor-core route; `weights_first`: the weights the dot's left operand ([block_n, 16]
    by x's [16, 16])."""
    weights_first: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.dequant != "e4m3" or self.groups != 1:
            raise ValueError("the tensor-core route takes dequant e4m3 and one scale group a step")


# mxfp4_gemv's E4M3 placement of four code bytes' nibbles, the values left in fp16 two a register
# (`mma_tile`'s operand).
_E4M3_F16 = """{{
.reg .b32 m, s, q;
.reg .b16 p0, p1;
{place}
or.b32 q, m, s;
mov.b32 {{p0, p1}}, q;
cvt.rn.f16x2.e4m3x2 $0, p0;
cvt.rn.f16x2.e4m3x2 $1, p1;
}}"""
_E4M3_F16_LO = _E4M3_F16.format(place=mg._PLACE_LO.format(x="$2"))
_E4M3_F16_HI = _E4M3_F16.format(place=mg._PLACE_HI.format(x="$2"))


def nibbles_f16(codes, *, ptx: bool):
    """uint8 code bytes -> (low-nibble, high-nibble) values times 2^-6 in fp16 (`_E4M3_F16`: every such value is
    a normal fp16, exact), off the GPU from jnp ops."""
    if ptx:
        out = jax.ShapeDtypeStruct(codes.shape, jnp.float16)
        return tuple(pltriton.elementwise_inline_asm(asm, args=[codes], pack=4, constraints="=r,=r,r",
                                                     result_shape_dtypes=[out])[0]
                     for asm in (_E4M3_F16_LO, _E4M3_F16_HI))
    c = codes.astype(jnp.int32)
    shift = mm.FP16_SHIFT / mg.E4M3_SHIFT
    return tuple((mm._e2m1_to_f32(nib) * shift).astype(jnp.float16) for nib in (c & 15, c >> 4))


def _pow2_exponent(v):
    """floor(log2(v)) for fp32 v > 0 normal, from its exponent bits (-127 for 0 and subnormals)."""
    return ((lax.bitcast_convert_type(v, jnp.int32) >> 23) & 0xFF) - 127


def _pow2(e):
    """2^e in fp32 for int32 e in [-126, 127], from its bits."""
    return lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def mma_tile(ex_ref, xw_ref, codes_ref, scales_ref, out_ref, r, ni, s, which: int, *, cfg: MmaConfig, rows: int,
              k: int, n: int, steps_per_split: int, count: int, per: int = 1):
    """`mxfp4_gemv._gemv_tile` with the products on the tensor cores: a scale group's 16 code rows are two [16, block_n]
    fp16 operands (low nibbles: the even K rows, high nibbles: the odd ones), each one instruction for two
    values (`_E4M3_F16`), where the FMA route converts each value on to fp32 and multiplies it there (~10
    instructions a code byte in all, issue-bound at about half the copy bandwidth: the module docstring). x
    is the other operand, in row 0 of a [16, 16] fp16 tile (the rest zeros): x times 2^t, t the power of two
    that brings the pair's largest |x| into [2^14, 2^15), so every x within 2^-28 of that largest is exact in
    fp16 (bf16's 8 bits fit fp16's 11) and the products are exact in the fp32 accumulator; smaller x round to
    fp16's subnormals. The group's products, summed by the dot, are scaled by the group's scale row and summed
    over the groups in K order (fp32), then times 2^-t. `weights_first` puts the weights on the left
    ([block_n, 16] tiles, x in column 0 of the right): the same sums with block_n as the dot's M, the shape
    Hopper's warpgroup products take.
    """
    bn = cfg.block_n
    c, col_ok, kh, code_base, scale_base, x_base, lo, hi = mg._span(ex_ref, r, ni, s, bn, cfg, k, n,
                                                                    steps_per_split, per)
    # the pair's x scale from all of its row (every program of the pair reads it: 4 bytes a code row)
    every = jnp.arange(1 << max(0, kh - 1).bit_length(), dtype=jnp.int32)
    xe_all, xo_all = mg._x_pair(pltriton.load(xw_ref.at[x_base + jnp.minimum(every, kh - 1)], mask=every < kh,
                                              other=0))
    amax = jnp.maximum(jnp.max(jnp.abs(xe_all)), jnp.max(jnp.abs(xo_all)))
    t = jnp.clip(14 - _pow2_exponent(amax), -126, 126)
    up, down = _pow2(t), _pow2(-t)
    i16 = jnp.arange(16, dtype=jnp.int32)
    wf = cfg.weights_first  # tiles [block_n, 16] (weights left), else [16, block_n] (x left)

    def load(kk, live):
        j = kk * 16 + i16  # the step's code rows
        ok = live & (j < kh)
        at, mask = ((c[:, None], j[None, :]), col_ok[:, None] & ok[None, :]) if wf else \
            ((c[None, :], j[:, None]), ok[:, None] & col_ok[None, :])
        codes = pltriton.load(codes_ref.at[(code_base + at[1]) * n + at[0]], mask=mask, other=0)
        xs = pltriton.load(xw_ref.at[x_base + jnp.minimum(j, kh - 1)], mask=ok, other=0)
        g_ok = live & (kk < k // 32)
        scales = pltriton.load(scales_ref.at[(scale_base + kk) * n + c], mask=col_ok & g_ok, other=0)
        return codes, xs, scales

    def step(tiles, acc):
        codes, xs, scales = tiles
        w_lo, w_hi = nibbles_f16(codes, ptx=not cfg.interpret)
        x_e, x_o = mg._x_pair(xs)
        def tile(v):  # x times 2^t in fp16, in column 0 (weights first) or row 0 of a [16, 16] tile of zeros
            h = (v * up).astype(jnp.float16)
            at = (i16[None, :] == 0, h[:, None]) if wf else (i16[:, None] == 0, h[None, :])
            return jnp.where(*at, 0).astype(jnp.float16)

        if wf:  # part [bn, 16], columns 1-15 zero
            part = pltriton.dot(w_lo, tile(x_e)) + pltriton.dot(w_hi, tile(x_o))
            return acc + mm._scale_f32(scales)[:, None] * part
        part = pltriton.dot(tile(x_e), w_lo) + pltriton.dot(tile(x_o), w_hi)  # [16, bn] fp32, rows 1-15 zero
        return acc + mm._scale_f32(scales)[None, :] * part

    acc = mm._steps(load, step, lo, hi, jnp.zeros((bn, 16) if wf else (16, bn), jnp.float32), ahead=cfg.ahead)
    out = (jnp.sum(acc, axis=1 if wf else 0) * (mg.E4M3_SHIFT * down)).astype(out_ref.dtype)  # x's row or column
    pltriton.store(out_ref.at[((s * count + which) * rows + r) * n + c], out, mask=col_ok)


_FMA_TILE = mg._gemv_tile


def dispatching_tile(*args, cfg, **kw):
    """`mxfp4_gemv._gemv_tile` as `installed()` makes it: `mma_tile` for an `MmaConfig`, else the FMA tile."""
    return (mma_tile if isinstance(cfg, MmaConfig) else _FMA_TILE)(*args, cfg=cfg, **kw)


@contextlib.contextmanager
def installed():
    """Within: `mxfp4_gemv`'s programs with an `MmaConfig` run `mma_tile`, the others as before."""
    mg._gemv_tile = dispatching_tile
    try:
        yield
    finally:
        mg._gemv_tile = _FMA_TILE
