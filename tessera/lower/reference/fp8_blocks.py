"""fp8 weights with one fp32 scale per N×N block (DeepSeek-V3's inference weights), and their quantiser.

A logical weight W [..., K, N_out] held as `fp8_e4m3 @scale(per_block(B))` (IR type `fp8_e4m3_bB`) is
  codes  float8_e4m3fn [..., K, N_out]:    one byte a weight, W / scale rounded to the e4m3 grid;
  scales float32      [..., K/B, N_out/B]: element (k, n) is scaled by scales[k // B, n // B].
The quantiser (the one init, loading and the tests use): per block, scale = amax · fp32(1/448) (448 is e4m3's
largest value; scale 1 for an all-zero block), codes = e4m3(clip(W / scale, ±448)), round to nearest even. The
scale is not rounded to a power of two, so each block's largest magnitude lands on ±448 and no range is lost;
it is a product with the fp32 reciprocal, not a division by 448, because XLA rewrites a division by a constant
into that product anyway (so the numpy model of the quantiser can match it bit for bit).
Dequantising is codes · scale in fp32, then cast: exact in fp32 up to its one rounding of the product.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
INV_E4M3_MAX = float(np.float32(1.0 / E4M3_MAX))  # the scale of a block is amax times this fp32 value


class FP8Blocks(NamedTuple):
    """A block-scaled fp8 weight of logical shape [..., K, N] (a pytree: codes and scales are its leaves)."""

    codes: jax.Array   # float8_e4m3fn [..., K, N]
    scales: jax.Array  # float32 [..., K/B, N/B]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [..., K, N] (the codes')."""
        return tuple(self.codes.shape)

    @property
    def ndim(self) -> int:
        """The logical rank (codes and scales have the same)."""
        return len(self.codes.shape)

    @property
    def block(self) -> int:
        """B: the side of the square blocks sharing one scale."""
        return self.codes.shape[-2] // self.scales.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes held: one per weight plus four per block."""
        return self.codes.nbytes + self.scales.nbytes


def _blocks_of(shape: tuple[int, ...], block: int) -> tuple[int, int]:
    """(K/B, N/B) of a logical [..., K, N] shape; ValueError when B does not divide K and N."""
    if len(shape) < 2 or shape[-2] % block or shape[-1] % block:
        raise ValueError(f"per_block({block}) fp8 storage needs the last two dims of {list(shape)} to be multiples "
                         f"of {block}")
    return shape[-2] // block, shape[-1] // block


def abstract(shape: tuple[int, ...], block: int) -> FP8Blocks:
    """ShapeDtypeStructs of the held form of a logical [..., K, N] weight (nothing allocated)."""
    kb, nb = _blocks_of(tuple(shape), block)
    sds = jax.ShapeDtypeStruct
    return FP8Blocks(sds(tuple(shape), jnp.float8_e4m3fn), sds((*shape[:-2], kb, nb), jnp.float32))


def _split(x: jax.Array, block: int) -> jax.Array:
    # [..., K, N] -> [..., K/B, B, N/B, B]: the blocks as axes -3 and -1 of their rows and columns
    *lead, k, n = x.shape
    return x.reshape(*lead, k // block, block, n // block, block)


def quantize(w: jax.Array, block: int) -> FP8Blocks:
    """fp [..., K, N] -> FP8Blocks: per B×B block scale = amax · fp32(1/448) (1 where amax = 0), codes =
    e4m3(w / scale)."""
    _blocks_of(tuple(w.shape), block)
    g = _split(jnp.asarray(w, jnp.float32), block)  # [..., K/B, B, N/B, B]
    amax = jnp.max(jnp.abs(g), axis=(-3, -1))  # [..., K/B, N/B]
    scales = jnp.where(amax > 0, amax * jnp.float32(INV_E4M3_MAX), 1.0).astype(jnp.float32)
    q = jnp.clip(g / scales[..., :, None, :, None], -E4M3_MAX, E4M3_MAX)
    return FP8Blocks(q.reshape(w.shape).astype(jnp.float8_e4m3fn), scales)


def dequantize(w: FP8Blocks, dtype=jnp.bfloat16) -> jax.Array:
    """The logical weight [..., K, N] in `dtype`: codes · their block's scale, in fp32, then cast."""
    v = _split(w.codes.astype(jnp.float32), w.block) * w.scales[..., :, None, :, None]
    return v.reshape(w.shape).astype(dtype)


def weight_only_einsum(spec: str, x: jax.Array, w: FP8Blocks, *, compute_dtype, out_dtype) -> jax.Array:
    """einsum(spec, x, W) for one token (decode at batch 1) without a dequantised copy of W: one fused
    multiply-and-reduce that reads each fp8 code once, W's elements taken as dequantize(w, compute_dtype) gives
    them and the products summed in fp32 over the contracted dims.

    Dequantising first writes W in the compute type and reads it back (1 + 2 + 2 bytes a weight against bf16's 2):
    on an H200, 24 of GPT-OSS-20B's q projections [2880, 64, 64] (per_block(64)) at one token took 1.36 ms that way
    against 1.31 ms in bf16 and 0.68 ms as this reduction (o: 1.17, 0.95 and 0.57 ms). At 8 tokens the reduction
    is ~2x slower than bf16 (each weight is read once per token), so the lowering takes it for one token only.
    The broadcast shape is the token dims followed by W's dims in W's own order, so the reduction runs over W's
    memory layout (a column reduction, coalesced) rather than a strided transpose of it."""
    a, b, o = spec.replace(" ", "").replace("->", ",").split(",")
    if not (set(a) & set(b)) - set(o) or not set(o) <= set(a) | set(b):
        raise ValueError(f"weight_only_einsum: {spec!r} contracts nothing or names an output dim no operand has")
    tokens = [c for c in a if c not in b]
    full = tokens + list(b)  # the product's dims: x's own, then W's in W's order
    contracted = [c for c in b if c in a and c not in o]
    xt = jnp.einsum(f"{a}->{''.join(c for c in full if c in a)}", x.astype(jnp.float32))
    xe = xt.reshape([x.shape[a.index(c)] if c in a else 1 for c in full])
    we = dequantize(w, compute_dtype).astype(jnp.float32)
    y = jnp.sum(xe * we, axis=tuple(full.index(c) for c in contracted))
    kept = [c for c in full if c not in contracted]
    return jnp.einsum(f"{''.join(kept)}->{o}", y).astype(out_dtype)
