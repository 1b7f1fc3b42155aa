"""fp8 codes and their scales: the two formats of the training recipe (e4m3 forward, e5m2 gradients) and the
exact power-of-two scale every fp8 product here takes, per tensor (`quantize`) or per block
(reference/fp8_per_block.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def pow2_scale(amax, dtype):
    """2^floor(log2(max_dtype / amax)) in fp32, exactly (1 where amax is 0 or not finite): the largest power of two
    k with amax · 2^k <= max, from the exponents and mantissas of amax and max (frexp, exact), the power built from
    its bits. XLA's log2 and exp2 are not exact (on the CPU exp2(13) is 8192.0039 and log2(57344 / 7) is just below
    13), which made scales that were not powers of two and rescaling that was not exact."""
    big = float(jnp.finfo(dtype).max)
    mb, eb = np.frexp(big)  # max = mb · 2^eb, mb in [0.5, 1)
    ok = (amax > 0) & jnp.isfinite(amax)
    ma, ea = jnp.frexp(jnp.where(ok, amax, 1.0).astype(jnp.float32))
    k = jnp.clip(eb - ea - (ma > mb).astype(jnp.int32), -126, 127)  # a normal fp32 power of two
    s = jax.lax.bitcast_convert_type((k + 127).astype(jnp.int32) << 23, jnp.float32)
    return jnp.where(ok, s, 1.0)


def codes(x, s, dtype):
    """x · s in fp32 rounded to fp8 `dtype`, saturating at its largest value: the codes of x at scale s (s one
    scale, or scales that broadcast against x)."""
    big = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * s, -big, big).astype(dtype)


def amax_of(x):
    """max |x| in fp32: the range a per-tensor scale and an amax history take."""
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


def quantize(x, dtype):
    """(x_q in fp8 `dtype`, s): x scaled by the power of two s that brings amax|x| just under the format's
    largest value, rounded to fp8 (saturating); x ≈ x_q / s. An all-zero x gets s = 1."""
    s = pow2_scale(amax_of(x), dtype)
    return codes(x, s, dtype), s


def split_spec(spec: str) -> tuple[str, str, str]:
    """(a, b, out) of a two-operand einsum spec "a,b->out" (no spaces)."""
    ins, out = spec.split("->")
    a, b = ins.split(",")
    return a, b, out
