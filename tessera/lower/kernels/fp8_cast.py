"""A gradient quantised to e5m2 in both layouts, with its amax, in one pass (Pallas, Triton backend).

The kernels of `reference.fp8_cast` (the module says what they compute and why): `cast_transpose_delayed` for a
materialised gradient [M, N], `swiglu_grad_delayed` for the gradients of gate and up formed from SwiGLU's
output gradient in the same pass (and SwiGLU's output again, as the down product's e4m3 codes transposed, with its
amax). One program per [bm, bn] tile reads its inputs once and writes the codes, the transposed codes (the [bn, bm]
tile at (j, i)) and the tile's amax of each gradient; the amaxes are reduced outside (a max: any order gives the
same number).

The scale is delayed scaling's: from the history row alone once it holds a range, which is known before the
pass. While a row is empty (a run's first step) the scale is the gradient's own amax, which one pass cannot know
before it writes a code: a first, reduce-only pass (`_amax_kernel`) measures it then. That pass runs every step,
as a program has one graph; each of its programs reads the rows' "known" flags and returns at once where they
hold a range, so after the first step it costs a launch of empty programs (no host round trip, unlike a
`lax.cond`, whose predicate XLA:GPU reads back to the host).

Numerics: the codes are the reference's `clip(x · s, ±max).astype(e5m2)`; SwiGLU's gradients follow the order
of operations of JAX's VJP of `reference.activations.swiglu` (then rounded to gate's dtype, as the step's are),
so they agree with the reference but where the GPU compilers contract a multiply and an add differently (the
tests bound how often and by how much: a code step at a rounding boundary).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl

from tessera.lower.kernels._vma import common, out_struct
from tessera.lower.kernels.mxfp4_matmul import _capability
from tessera.lower.reference import activations
from tessera.lower.reference.fp8 import delayed_scale, known
from tessera.lower.reference.fp8_scale import E4M3, E5M2, codes


@dataclasses.dataclass(frozen=True)
class CastConfig:
    """[bm, bn]: the tile of the writing pass; [amax_bm, amax_bn]: the first step's reduce-only pass's."""
    bm: int = 64
    bn: int = 128
    amax_bm: int = 128
    amax_bn: int = 256
    num_warps: int = 4
    interpret: bool = False

    def __post_init__(self):
        for name in ("bm", "bn", "amax_bm", "amax_bn"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two >= 16 (Triton tiles)")


DEFAULT = CastConfig()
# SwiGLU's pass writes five tiles (two gradients' codes both ways, h's transposed): at the Llama-1B shape (16384 x
# 8192, one H100, session 49) 32 x 128 took 718 us, 32 x 64 735, 64 x 64 761, 64 x 128 841, 128 x 64 866, 16 x 128
# 927, 128 x 128 3,892 (spilling)
SWIGLU = CastConfig(bm=32)


def fitted(m: int, n: int, config: CastConfig = DEFAULT) -> CastConfig | None:
    """`config` with each tile dim cut to the largest power of two (>= 16) that divides [m, n], or None where none
    does: a test's small shapes in the interpreter, a model whose width is not a multiple of 128."""
    def cut(want: int, dim: int) -> int | None:
        b = want
        while b >= 16 and dim % b:
            b //= 2
        return b if b >= 16 else None

    tiles = {"bm": cut(config.bm, m), "bn": cut(config.bn, n), "amax_bm": cut(config.amax_bm, m),
             "amax_bn": cut(config.amax_bn, n)}
    return None if None in tiles.values() else dataclasses.replace(config, **tiles)


def supported(*operands, config: CastConfig = DEFAULT) -> bool:
    """Whether the kernels take these [M, N] operands (bf16, fp16 or fp32, all one shape, whole tiles of both
    passes) on this device: Hopper or newer (e5m2 conversions), or the interpreter where `config` asks."""
    if not config.interpret and (_capability() or (0, 0)) < (8, 9):
        return False
    shape = operands[0].shape
    if len(shape) != 2 or any(o.shape != shape for o in operands):
        return False
    if any(jnp.dtype(o.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
           for o in operands):
        return False
    m, n = shape
    return all(m % b == 0 for b in (config.bm, config.amax_bm)) and all(n % b == 0 for b in (config.bn,
                                                                                             config.amax_bn))


def _swiglu_grads(dh_ref, g_ref, u_ref):
    """d gate, d up of one tile in fp32, each rounded to gate's dtype (JAX's VJP's order of operations)."""
    dg, du = activations.swiglu_grads_wide(g_ref[...].astype(jnp.float32), u_ref[...].astype(jnp.float32),
                                           dh_ref[...].astype(jnp.float32))
    wide = g_ref.dtype
    return dg.astype(wide).astype(jnp.float32), du.astype(wide).astype(jnp.float32)


def _swiglu(dh_ref, g_ref, u_ref):
    """h = swiglu(gate, up) of one tile (reference/activations.py: in fp32, rounded to gate's dtype once), fp32."""
    h = activations.swiglu_wide(g_ref[...].astype(jnp.float32), u_ref[...].astype(jnp.float32))
    return h.astype(g_ref.dtype).astype(jnp.float32)


def _plain(x_ref):
    return (x_ref[...].astype(jnp.float32),)


def _writing_kernel(grads, n: int, value=None):
    """The writing pass over one tile: refs (scales, [value's scale,] *inputs, then per gradient its codes and
    codes.T, then per gradient its tile amax[, then value's e4m3 codes.T and its tile amax])."""
    extra = value is not None

    def kernel(s_ref, *refs):
        v_scale, refs = (refs[0], refs[1:]) if extra else (None, refs)
        count = 3 * n + 2 * extra
        ins, outs = refs[:len(refs) - count], refs[len(refs) - count:]
        for i, v in enumerate(grads(*ins)):
            q = codes(v, s_ref[i], E5M2)
            outs[2 * i][...] = q
            outs[2 * i + 1][...] = q.T
            outs[2 * n + i][...] = jnp.max(jnp.abs(v)).reshape(1, 1)
        if extra:
            h = value(*ins)
            outs[3 * n][...] = codes(h, v_scale[0], E4M3).T
            outs[3 * n + 1][...] = jnp.max(jnp.abs(h)).reshape(1, 1)
    return kernel


def _amax_kernel(grads, n: int):
    """The first step's pass over one tile: each gradient's tile amax, or 0 where every row holds a range."""
    def kernel(flag_ref, *refs):
        ins, outs = refs[:len(refs) - n], refs[len(refs) - n:]

        @pl.when(flag_ref[0] == 0)
        def _():
            for o, v in zip(outs, grads(*ins)):
                o[...] = jnp.max(jnp.abs(v)).reshape(1, 1)

        @pl.when(flag_ref[0] != 0)
        def _():
            for o in outs:
                o[...] = jnp.zeros((1, 1), jnp.float32)
    return kernel


def _compiler(config: CastConfig) -> dict:
    if config.interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as pltriton

    return {"compiler_params": pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1)}


def _tile_amaxes(kernel, operands, n: int, bm: int, bn: int, extra, config: CastConfig):
    m, cols = operands[0].shape
    grid = (m // bm, cols // bn)
    one = pl.BlockSpec((1, 1), lambda i, j: (i, j))
    return pl.pallas_call(
        kernel, grid=grid,
        in_specs=[pl.BlockSpec(extra.shape, lambda i, j: (0,))] + [pl.BlockSpec((bm, bn), lambda i, j: (i, j))]
        * len(operands),
        out_specs=[one] * n, out_shape=[out_struct(grid, jnp.float32, *operands)] * n, **_compiler(config),
    )(extra, *operands)


def _quantised(grads, operands, rows, n: int, config: CastConfig, value=None, value_scale=None):
    """(codes, codes.T) per gradient[, then `value`'s e4m3 codes.T at `value_scale`], then the amaxes[, then value's
    last], then the scales: the two passes."""
    operands = common(*operands)
    m, cols = operands[0].shape
    have = jnp.stack([known(r) for r in rows])
    first = _tile_amaxes(_amax_kernel(grads, n), operands, n, config.amax_bm, config.amax_bn,
                         jnp.all(have).astype(jnp.int32).reshape(1), config)
    scales = jnp.stack([delayed_scale(r, E5M2, jnp.max(a)) for r, a in zip(rows, first)])
    grid = (m // config.bm, cols // config.bn)
    tile = pl.BlockSpec((config.bm, config.bn), lambda i, j: (i, j))
    tile_t = pl.BlockSpec((config.bn, config.bm), lambda i, j: (j, i))
    one = pl.BlockSpec((1, 1), lambda i, j: (i, j))
    pair = [out_struct((m, cols), E5M2, *operands), out_struct((cols, m), E5M2, *operands)]
    extra = [] if value is None else [jnp.asarray(value_scale, jnp.float32).reshape(1)]
    out = pl.pallas_call(
        _writing_kernel(grads, n, value), grid=grid,
        in_specs=[pl.BlockSpec((n,), lambda i, j: (0,))] + [pl.BlockSpec((1,), lambda i, j: (0,))] * len(extra)
        + [tile] * len(operands),
        out_specs=[tile, tile_t] * n + [one] * n + [tile_t, one] * len(extra),
        out_shape=pair * n + [out_struct(grid, jnp.float32, *operands)] * n
        + [out_struct((cols, m), E4M3, *operands), out_struct(grid, jnp.float32, *operands)] * len(extra),
        **_compiler(config),
    )(scales, *extra, *operands)
    return out[:2 * n] + out[3 * n:3 * n + 1], [jnp.max(a) for a in out[2 * n:3 * n] + out[3 * n + 1:]], scales


def cast_transpose_delayed(g, row, *, config: CastConfig = DEFAULT):
    """`reference.fp8_cast.cast_transpose_delayed` in one pass (two on a first step)."""
    (q, t), (amax,), s = _quantised(_plain, (g,), [row], 1, config)
    return q, t, amax, s[0]


def swiglu_grad_delayed(dh, gate, up, rows, h_scale, *, config: CastConfig = DEFAULT):
    """`reference.fp8_cast.swiglu_grad_delayed` in one pass (two on a first step)."""
    (qg, tg, qu, tu, ht), (ag, au, ah), s = _quantised(_swiglu_grads, (dh, gate, up), [rows[0], rows[1]], 2, config,
                                                       _swiglu, h_scale)
    return qg, tg, qu, tu, ag, au, s[0], s[1], ht, ah
