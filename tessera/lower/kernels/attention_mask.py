"""Block ranges and tile masks shared by the attention kernels (positions as in reference/attention.py).

Query row i sits at position `q_offset + i`; key j at j. Key j is visible to position p when
j < kv_len, and (causal) j <= p, and (window) p - j < window.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax

from tessera.lower.kernels import _mgpu


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Masking of one attention call: causal, window (None = unbounded), offsets and lengths.

    q_offset and kv_len are Python ints in the prefill kernels; decode reads them per batch at run
    time (traced int32 scalars), which `key_range`, `full_range` and `visible` accept.
    """
    causal: bool
    window: int | None
    q_offset: int | jax.Array
    kv_len: int | jax.Array  # valid keys; keys at or past it are padding
    # whether the kernel's key tiles reach past kv_len; if not, tiles skip the length test
    keys_padded: bool = True
    # causal window tiles as one tile of q - k (the iota difference plus a scalar): a score then
    # pays one add, one unsigned compare and the select, against ~2x that for two signed tests
    # (H200, D64 forward, window 128 + sinks: 262-289 -> 220-240 us). But LLVM hoists the
    # loop-invariant difference out of the KV loop, one register a score: the D128 forward
    # spilled with it (causal 963-981 -> 1112 us), so only kernels with registers to spare set it.
    diff_tile: bool = False

    def key_range(self, p_first, p_last, block: int):
        """Blocks [lo, hi) of `block` keys holding any key visible to positions p_first..p_last."""
        if self.window is None:
            lo = _traced_zero(jnp.maximum(p_first, 0))  # positions may be negative (front padding)
        else:
            lo = _div(jnp.maximum(p_first - self.window + 1, 0), block)
        hi = jnp.maximum(_cdiv(self._key_end(p_last), block), lo)
        return lo, hi

    def _key_end(self, p_last):
        """One past the last key any of the positions up to p_last sees."""
        return jnp.int32(self.kv_len) if not self.causal else jnp.minimum(p_last + 1, self.kv_len)

    def full_range(self, p_first, p_last, block: int, lo, hi):
        """Blocks [a, b) within [lo, hi) whose every key is visible to every position p_first..p_last."""
        a = lo if self.window is None else _cdiv(jnp.maximum(p_last - self.window + 1, 0), block)
        b = jnp.int32(self.kv_len // block)
        if self.causal:
            b = jnp.minimum(b, _div(p_first + 1, block))
        a = jnp.clip(a, lo, hi)
        return a, jnp.clip(b, a, hi)

    def may_have_full_blocks(self, rows: int, block: int) -> bool:
        """Whether some block of `block` keys can be fully visible to `rows` consecutive positions.
        Causal with window < rows + block - 1 rules it out: the first row must see the block's last
        key (causal) and the last row its first key (window)."""
        return not (self.causal and self.window is not None and self.window < rows + block - 1)

    def half_edges(self, p_first, p_last, block: int, lo, full_lo, full_hi, hi):
        """(up, down), 0 or 1 each: whether the first block of the leading masked stretch
        [lo, full_lo) holds no key visible to p_first..p_last in its first half (up; None without
        a window, which never cuts there), and the last block of the trailing one [full_hi, hi)
        none in its second half (down)."""
        half = block // 2
        up = None
        if self.window is not None:
            first_key = p_first - self.window + 1  # the first key any of the positions sees
            up = ((lo < full_lo) & (first_key >= lo * block + half)).astype(jnp.int32)
        down = ((full_hi < hi) & (self._key_end(p_last) <= (hi - 1) * block + half)).astype(jnp.int32)
        return up, down

    def query_range(self, k_first, k_last, block: int, num_q_blocks: int):
        """Query blocks [lo, hi) (rows, not positions) that see any key k_first..k_last."""
        lo = _traced_zero(k_first)
        if self.causal:
            lo = _div(jnp.maximum(k_first - self.q_offset, 0), block)
        if self.window is None:
            hi = jnp.int32(num_q_blocks)
        else:
            last_row = k_last + self.window - 1 - self.q_offset  # the last row that sees k_last
            hi = jnp.minimum(_div(jnp.maximum(last_row + block, 0), block), num_q_blocks)
        return lo, jnp.maximum(hi, lo)

    def full_query_range(self, k_first, k_last, block: int, lo, hi):
        """Query blocks [a, b) within [lo, hi) whose every row sees every key k_first..k_last."""
        a = lo if not self.causal else _cdiv(jnp.maximum(k_last - self.q_offset, 0), block)
        if self.window is None:
            b = hi
        else:  # the block's last position must still see k_first: p_last - k_first < window
            b = _div(jnp.maximum(k_first + self.window - self.q_offset, 0), block)
        b = jnp.where(k_last < self.kv_len, b, lo)  # padding keys are always masked
        a = jnp.clip(a, lo, hi)
        return a, jnp.clip(b, a, hi)

    def visible(self, q_pos, k_pos):
        """Elementwise visibility of int32 position tiles (same shape)."""
        tests = []
        if self.keys_padded:
            tests.append(k_pos < self.kv_len)
        if self.causal:
            tests.append(k_pos <= q_pos)
        if self.window is not None:
            tests.append(q_pos - k_pos < self.window)
        if not tests:  # a masked tile with nothing to test: every pair is visible
            return k_pos == k_pos  # (all true, in the tiles' layout)
        return functools.reduce(operator.and_, tests)

    def _in_window(self, d):
        """0 <= d < window for d = position - key: one unsigned compare (a negative d wraps past it)."""
        return d.astype(jnp.uint32) < jnp.uint32(self.window)

    def tile(self, q_first, k_first, shape, *, interpret: bool, transposed: bool = False):
        """Visibility of a [rows, cols] accumulator tile; rows are queries (keys when transposed)."""
        rows = _mgpu.iota2d(shape, 0, interpret=interpret)
        cols = _mgpu.iota2d(shape, 1, interpret=interpret)
        q_idx, k_idx = (cols, rows) if transposed else (rows, cols)
        if self.diff_tile and self.causal and self.window is not None:
            seen = self._in_window((q_idx - k_idx) + (q_first - k_first))
            return seen & (k_idx + k_first < self.kv_len) if self.keys_padded else seen
        return self.visible(q_idx + q_first, k_idx + k_first)


def masked_stretches(step, carry, lo, full_lo, full_hi, hi):
    """`step(i, carry, masked=...)` over [lo, full_lo) masked, [full_lo, full_hi) fully visible,
    [full_hi, hi) masked: three loops, so a fully visible block traces no mask."""
    for a, b, masked in ((lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True)):
        carry = lax.fori_loop(a, b, functools.partial(step, masked=masked), carry)
    return carry


def _traced_zero(nonneg):
    """0 as a traced int32: Mosaic GPU's loop lowering rejects Python constants as loop bounds."""
    return jnp.minimum(nonneg, 0)


def _div(a, b: int):
    """a // b for non-negative int32 a (lax.div truncates, which equals floor here)."""
    return lax.div(a, jnp.int32(b))


def _cdiv(a, b: int):
    return _div(a + (b - 1), b)
