"""Rotary position embeddings: inverse frequencies (plain, YaRN, Llama-3) and their application.

Frequencies follow Hugging Face's `modeling_rope_utils` exactly (fp32, `dim` = rotary head dim):
  plain:  inv_freq[i] = 1 / theta^(2i/dim),  i < dim/2
  yarn:   blend of extrapolated (inv_freq) and interpolated (inv_freq / factor) frequencies with a
          linear ramp over [low, high] = correction range of (beta_fast, beta_slow) rotations within
          `original` positions (floored/ceiled only when `truncate`; GPT-OSS sets truncate=False);
          cos and sin are multiplied by the attention scaling 0.1 * ln(factor) + 1.
  llama3: wavelengths longer than original/low_freq_factor divided by factor, shorter than
          original/high_freq_factor kept, smooth blend between.
  rotary2d: a grid's cells in row-major order, position p the cell (p // cols, p % cols); the first half of
          the D/2 rotated pairs turn with the row, the second with the column, each half at the plain
          frequencies of a head of D/2 (Heo et al., "Rotary Position Embedding for Vision Transformer", 2024).
Application is rotate-half on x [B, S, H, D]: out = x * cos + rotate_half(x) * sin with
rotate_half(x) = concat(-x2, x1) over the two halves of D, cos/sin [B|1, S, D/2] repeated twice.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tessera.lower.reference._dtypes import wide


def rope_inv_freq(*, head_dim: int, theta: float) -> np.ndarray:
    """Plain RoPE inverse frequencies, fp32 [head_dim // 2]."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def yarn_attention_scaling(factor: float) -> float:
    """YaRN's cos/sin multiplier: 0.1 * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, theta: float, original: int) -> float:
    # the dimension index whose wavelength makes `rotations` turns within `original` positions
    return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def yarn_inv_freq(*, head_dim: int, theta: float, factor: float, original: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True) -> tuple[np.ndarray, float]:
    """YaRN inverse frequencies fp32 [head_dim // 2] and the attention scaling for cos/sin."""
    low = _correction_dim(beta_fast, head_dim, theta, original)
    high = _correction_dim(beta_slow, head_dim, theta, original)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim))
    extrapolated = np.float32(1.0) / pos_freqs
    interpolated = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp).astype(np.float32)  # 1 = extrapolate (high frequencies)
    inv_freq = interpolated * (np.float32(1.0) - keep) + extrapolated * keep
    return inv_freq.astype(np.float32), yarn_attention_scaling(factor)


def llama3_inv_freq(*, head_dim: int, theta: float, factor: float, original: int, low_freq_factor: float = 1.0,
                    high_freq_factor: float = 4.0) -> np.ndarray:
    """Llama-3.1 scaled inverse frequencies, fp32 [head_dim // 2]."""
    inv_freq = rope_inv_freq(head_dim=head_dim, theta=theta)
    wavelen = np.float32(2 * math.pi) / inv_freq
    low_wavelen, high_wavelen = original / low_freq_factor, original / high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


class RopeTable(NamedTuple):
    """What a rope kind makes of a head: inverse frequencies fp32 [D/2], the cos/sin scaling, and for a 2-D
    kind the grid's column count (the coordinate of each rotated pair is then the row or the column)."""

    inv_freq: np.ndarray
    scaling: float = 1.0
    cols: int | None = None


def rotary2d_inv_freq(*, head_dim: int, theta: float) -> np.ndarray:
    """2-D rotary inverse frequencies fp32 [head_dim // 2]: the plain ones of a head_dim / 2 head, for the row
    pairs then again for the column pairs."""
    half = rope_inv_freq(head_dim=head_dim // 2, theta=theta)
    return np.concatenate([half, half])


def grid_coords(positions: jax.Array, *, cols: int, pairs: int) -> jax.Array:
    """int [..., S, pairs]: the row (p // cols) for the first half of the rotated pairs, the column (p % cols)
    for the second."""
    row, col = positions // cols, positions % cols
    return jnp.where(jnp.arange(pairs) < pairs // 2, row[..., None], col[..., None])


def rope_cos_sin(positions: jax.Array, *, inv_freq, scaling: float = 1.0,
                 cols: int | None = None) -> tuple[jax.Array, jax.Array]:
    """cos, sin fp32 [..., S, D/2] for integer positions [..., S], each times `scaling`; with `cols`, positions
    are cells of a row-major grid of that many columns (rotary2d)."""
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    if cols is None:
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., S, D/2]
    else:
        freqs = grid_coords(positions, cols=cols, pairs=inv_freq.shape[-1]).astype(jnp.float32) * inv_freq
    return jnp.cos(freqs) * scaling, jnp.sin(freqs) * scaling


def apply_rope(x: jax.Array, *, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x [B, S, H, D] with cos, sin [B|1, S, D/2]; computed in fp32, returns x's dtype."""
    xf = x.astype(wide(x.dtype, cos.dtype))
    x1, x2 = jnp.split(xf, 2, axis=-1)  # [B, S, H, D/2] each
    c = cos[..., :, None, :].astype(xf.dtype)  # [B|1, S, 1, D/2]
    s = sin[..., :, None, :].astype(xf.dtype)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
