"""Weights held in a packed form (`MXFP4` codes + E8M0 scales, `FP8Blocks` fp8 codes + fp32 block scales) as
the lowerings read them: `dense` dequantises at use, so every op taking a weight takes either."""

from __future__ import annotations

from tessera.lower.reference import fp8_blocks, mxfp4

PACKED = (mxfp4.MXFP4, fp8_blocks.FP8Blocks)  # the pytrees a parameter may be held as


def is_packed(w) -> bool:
    """Whether `w` is a packed weight (a pytree of codes and scales) rather than a plain array."""
    return isinstance(w, PACKED)


def dequantize(w, dtype):
    """A packed weight as the plain array [..., K, N] of `dtype` it stands for."""
    if isinstance(w, mxfp4.MXFP4):
        return mxfp4.dequantize(w, dtype)
    return fp8_blocks.dequantize(w, dtype)


def dense(w, dtype):
    """`w` as a plain array of `dtype`: a packed weight dequantised, anything else cast."""
    return dequantize(w, dtype) if is_packed(w) else w.astype(dtype)
