"""MXFP4 (OCP microscaling FP4) expert weights as GPT-OSS checkpoints store them.

A weight W [E, in, out] (Hugging Face's expert layout) is stored transposed, in groups of 32 along
the input dimension:
  `<name>_blocks` uint8 [E, out, in/32, 16]: two E2M1 codes a byte, the LOW nibble the even element;
  `<name>_scales` uint8 [E, out, in/32]:     E8M0 exponents, the group's scale is 2^(s - 127).
An E2M1 code is sign (bit 3) and magnitude index (bits 0-2) into {0, .5, 1, 1.5, 2, 3, 4, 6}.
"""

from __future__ import annotations

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                dtype=np.float32)
GROUP = 32


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., out, G, 16], scales uint8 [..., out, G] -> fp32 [..., G*32, out] (input-major)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    blocks = blocks.astype(np.uint8)
    values = np.empty(blocks.shape[:-1] + (GROUP,), np.float32)  # [..., out, G, 32]
    values[..., 0::2] = E2M1[blocks & 0x0F]
    values[..., 1::2] = E2M1[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    w = values.reshape(values.shape[:-2] + (-1,))  # [..., out, in]
    return np.swapaxes(w, -1, -2)


def encode_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp [..., in, out] -> (blocks, scales) as above; per group scale 2^ceil(log2(amax / 6)), nearest E2M1 value."""
    wt = np.swapaxes(np.asarray(w, np.float32), -1, -2)  # [..., out, in]
    if wt.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the input dimension ({wt.shape[-1]}) to be a multiple of {GROUP}")
    g = wt.reshape(wt.shape[:-1] + (-1, GROUP))  # [..., out, G, 32]
    amax = np.abs(g).max(-1)
    mant, e = np.frexp(np.maximum(amax, np.float32(1e-38)) / np.float32(6.0))  # mant in [0.5, 1)
    exp = np.where(amax > 0, e - (mant == 0.5), 0).astype(np.int32)  # ceil(log2(amax / 6)), exactly
    exp = np.clip(exp, -127, 127)
    scaled = np.ldexp(g, -exp[..., None]).astype(np.float32)
    codes = np.abs(np.abs(scaled)[..., None] - E2M1[:8]).argmin(-1).astype(np.uint8)
    codes |= (np.signbit(scaled) & (codes > 0)).astype(np.uint8) << 3
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), (exp + 127).astype(np.uint8)


def packed_from_hf(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF blocks [..., out, in/32, 16] + scales [..., out, in/32] -> Tessera's packed (codes [..., in/2, out],
    scales [..., in/32, out]) (tessera/lower/reference/mxfp4.py): the same bytes, the [out, in] transpose undone."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    codes = blocks.reshape(blocks.shape[:-2] + (-1,))  # [..., out, in/2]: byte b holds elements 2b, 2b+1
    return np.swapaxes(codes, -1, -2), np.swapaxes(scales, -1, -2)


def packed_to_hf(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `packed_from_hf`: (codes, scales) in Tessera's layout -> HF (blocks, scales)."""
    blocks = np.swapaxes(codes, -1, -2)  # [..., out, in/2]
    return (np.ascontiguousarray(blocks.reshape(blocks.shape[:-1] + (-1, GROUP // 2))),
            np.ascontiguousarray(np.swapaxes(scales, -1, -2)))


def decode_packed(w) -> np.ndarray:
    """A packed weight in Tessera's layout (anything with `codes` and `scales`) -> fp32 [..., in, out]."""
    return decode_mxfp4(*packed_to_hf(np.asarray(w.codes), np.asarray(w.scales)))
