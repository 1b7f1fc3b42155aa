"""MXFP4 (OCP microscaling FP4) weights kept packed in memory, and the `jax.numpy` reference ops on them.

A logical weight W [..., K, N] (K the contraction dim, N the output dim, our [in, out] layout) is held as
  codes  uint8 [..., K/2, N]:  two E2M1 codes a byte along K, the LOW nibble the even k;
  scales uint8 [..., K/32, N]: E8M0 exponents, element (k, n) is scaled by 2^(scales[k // 32, n] - 127).
An E2M1 code is sign (bit 3) and magnitude index (bits 0-2) into {0, .5, 1, 1.5, 2, 3, 4, 6}. This is
GPT-OSS's checkpoint format (tessera/lower/hf/mxfp4.py) with the [out, in] transpose undone, so the same
PartitionSpec shards codes, scales and the logical weight (K/2 and K/32 split where K does).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tessera.lower.reference import accum as accum_ref

GROUP = 32  # elements sharing one E8M0 scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class MXFP4(NamedTuple):
    """A packed MXFP4 weight of logical shape [..., K, N] (a pytree: codes and scales are its leaves)."""

    codes: jax.Array   # uint8 [..., K/2, N]
    scales: jax.Array  # uint8 [..., K/32, N]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [..., K, N]."""
        return self.codes.shape[:-2] + (2 * self.codes.shape[-2], self.codes.shape[-1])

    @property
    def ndim(self) -> int:
        """The logical rank (codes and scales have the same)."""
        return self.codes.ndim

    @property
    def nbytes(self) -> int:
        """Bytes held: codes plus scales (4.25 bits per logical element)."""
        return self.codes.nbytes + self.scales.nbytes


def abstract(shape: tuple[int, ...]) -> MXFP4:
    """ShapeDtypeStructs of the packed form of a logical [..., K, N] weight (nothing allocated)."""
    *lead, k, n = shape
    if k % GROUP:
        raise ValueError(f"MXFP4 needs the contraction dimension ({k}) to be a multiple of {GROUP}")
    sds = jax.ShapeDtypeStruct
    return MXFP4(sds((*lead, k // 2, n), jnp.uint8), sds((*lead, k // GROUP, n), jnp.uint8))


def dense(w, dtype):
    """`w` as a plain array of `dtype`: an MXFP4 weight dequantised, anything else cast."""
    return dequantize(w, dtype) if isinstance(w, MXFP4) else w.astype(dtype)


def dequantize(w: MXFP4, dtype=jnp.bfloat16) -> jax.Array:
    """The logical weight [..., K, N] in `dtype` (exact: every MXFP4 value is a bf16 value)."""
    table = jnp.asarray(E2M1, jnp.float32)
    c = w.codes.astype(jnp.int32)
    lo, hi = table[c & 0x0F], table[c >> 4]  # [..., K/2, N] the even and the odd k
    v = jnp.stack([lo, hi], axis=-2).reshape(w.shape)  # interleave along K
    v = v.reshape(w.shape[:-2] + (-1, GROUP, w.shape[-1]))  # [..., K/32, 32, N]
    v = jnp.ldexp(v, w.scales.astype(jnp.int32)[..., None, :] - 127)  # exact (exp2 is not, on XLA:CPU)
    return v.reshape(w.shape).astype(dtype)


def quantize(w: jax.Array) -> MXFP4:
    """fp [..., K, N] -> MXFP4: per group of 32 along K the scale 2^ceil(log2(amax / 6)), nearest E2M1 value."""
    if w.shape[-2] % GROUP:
        raise ValueError(f"MXFP4 needs the contraction dimension ({w.shape[-2]}) to be a multiple of {GROUP}")
    wf = jnp.asarray(w, jnp.float32)
    g = wf.reshape(wf.shape[:-2] + (-1, GROUP, wf.shape[-1]))  # [..., K/32, 32, N]
    amax = jnp.max(jnp.abs(g), axis=-2)
    mant, e = jnp.frexp(jnp.maximum(amax, 1e-38) / 6.0)  # amax/6 = mant * 2^e, mant in [0.5, 1)
    exp = jnp.where(amax > 0, e - (mant == 0.5), 0)  # ceil(log2(amax / 6)), exactly (log2 is not)
    exp = jnp.clip(exp, -127, 127)
    scaled = jnp.ldexp(g, -exp[..., None, :])
    # nearest magnitude, ties to the smaller (as argmin over the distances): count the midpoints passed
    mids = [(a + b) / 2 for a, b in zip(E2M1[:7], E2M1[1:8])]
    mag = jnp.abs(scaled)
    idx = sum((mag > m).astype(jnp.uint8) for m in mids)  # no [..., 8] distance tensor: init of 20b fits
    idx = idx | ((jnp.signbit(scaled) & (idx > 0)).astype(jnp.uint8) << 3)
    idx = idx.reshape(wf.shape)  # [..., K, N]
    codes = idx[..., 0::2, :] | (idx[..., 1::2, :] << 4)
    return MXFP4(codes.astype(jnp.uint8), (exp + 127).astype(jnp.uint8))


def matmul(x: jax.Array, w: MXFP4, *, preferred_element_type=None) -> jax.Array:
    """x [..., K] @ W [K, N] -> [..., N], the weight dequantised to x's dtype first."""
    return jnp.matmul(x, dequantize(w, x.dtype), preferred_element_type=preferred_element_type)


def ragged_dot(lhs: jax.Array, rhs: MXFP4, group_sizes: jax.Array, preferred_element_type=None,
               accum=None) -> jax.Array:
    """`jax.lax.ragged_dot` with packed experts rhs [G, K, N]: rows of lhs [M, K] grouped by group_sizes [G].

    With fewer rows than groups (decoding) each row gathers its group's packed bytes and only those
    M weights are dequantised (M·K·N instead of G·K·N); rows past sum(group_sizes) give zeros.
    """
    m, g = lhs.shape[0], rhs.codes.shape[0]
    if m < g:
        ends = jnp.cumsum(group_sizes)
        gid = jnp.searchsorted(ends, jnp.arange(m, dtype=ends.dtype), side="right")  # [M] group of row m
        out = pair_dot(lhs, rhs, jnp.minimum(gid, g - 1), preferred_element_type=preferred_element_type,
                       accum=accum)
        return jnp.where((gid < g)[:, None], out, jnp.zeros((), out.dtype))
    if accum_ref.narrow(accum):
        return accum_ref.ragged_dot(lhs, dequantize(rhs, lhs.dtype), group_sizes, accum=accum,
                                    preferred_element_type=preferred_element_type)
    return jax.lax.ragged_dot(lhs, dequantize(rhs, lhs.dtype), group_sizes,
                              preferred_element_type=preferred_element_type)


def several(rhs) -> bool:
    """Whether an expert operand is a tuple of matrices (an expert's gate and up, one launch) rather than one
    matrix (an array, or an MXFP4, itself a NamedTuple)."""
    return isinstance(rhs, tuple) and not isinstance(rhs, MXFP4)


def pair_dot(lhs: jax.Array, rhs, experts: jax.Array, preferred_element_type=None, accum=None) -> jax.Array:
    """Row r of lhs [R, K] times expert experts[r] of rhs [G, K, N] (packed MXFP4 or plain) -> [R, N].

    The few-copies form of an expert product (decode: one row per (token, expert) pair, in any order):
    each row gathers only its expert's weights, and nothing is sorted or counted. `accum`: the accumulation
    type where narrower than fp32 (reference/accum.py). `rhs` a tuple of matrices: a tuple of products.
    """
    if several(rhs):
        return tuple(pair_dot(lhs, m, experts, preferred_element_type, accum) for m in rhs)
    w = dense(jax.tree.map(lambda a: a[experts], rhs), lhs.dtype)  # [R, K, N]
    if accum_ref.narrow(accum):
        return accum_ref.einsum("rk,rkn->rn", lhs, w, accum=accum, preferred_element_type=preferred_element_type)
    return jnp.einsum("rk,rkn->rn", lhs, w, preferred_element_type=preferred_element_type)


def any_ragged_dot(lhs, rhs, group_sizes, preferred_element_type=None, accum=None):
    """`jax.lax.ragged_dot` that also takes a packed MXFP4 rhs (then `ragged_dot` above); `accum` where
    narrower than fp32 accumulates as reference/accum.py says."""
    if isinstance(rhs, MXFP4):
        return ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type, accum=accum)
    if accum_ref.narrow(accum):
        return accum_ref.ragged_dot(lhs, rhs, group_sizes, accum=accum, preferred_element_type=preferred_element_type)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)
