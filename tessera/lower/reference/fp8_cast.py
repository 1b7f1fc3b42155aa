"""A gradient quantised for its two fp8 products under delayed scaling: the codes in both layouts, the amax.

In a train step under `fp8_e4m3 @scale(delayed(H))` each product's backward quantises its output gradient g to
e5m2 once and reads it twice: the input gradient's GEMM g ⊗ wᵀ reads g as it is ([tokens, out]), the weight
gradient's GEMM xᵀ ⊗ g reads it token-minor ([out, tokens]: cuBLASLt's fp8 GEMM takes both operands contiguous
along the contracted dim). The scale is delayed scaling's (`fp8.quantize_delayed`): the power of two from the
max of the history row, or from g's own amax while that row is empty (the first step); g's amax is measured for
the history either way. These are the references of the lowering table's primitives (tessera/lower/table.py)
that a kernel may compute in one pass (tessera/lower/kernels/fp8_cast.py):

- `cast_transpose_delayed(g, row)`: a materialised gradient [M, N];
- `swiglu_grad_delayed(dh, gate, up, rows, h_scale)`: the gradients of gate and up through SwiGLU
  (h = silu(gate) · up) from h's gradient dh, each quantised so, and h's own e4m3 codes transposed (what the down
  product's weight gradient reads): the MLP's backward (tessera/lower/fp8_mlp.py), where XLA's one fusion of
  SwiGLU's backward, both casts and both transposes took ~2.5x its bytes' time, and its fusion recomputing h's
  codes transposed 730 us a layer (the Llama-1B step, one H100, session 49's profile).

Each returns codes [M, N] (e5m2), codes.T, amax (fp32 scalar) and scale (fp32 scalar) per gradient: the numbers
of the products' own quantisation (reference/fp8.py) bit for bit; the transposed codes are what XLA would
transpose, here named so a kernel can write them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.reference import activations, fp8
from tessera.lower.reference.fp8_scale import E4M3, E5M2, codes


def cast_transpose_delayed(g, row):
    """(g_q [M, N], g_qᵀ [N, M] in e5m2, amax |g|, s) of a gradient g [M, N] with delayed scaling's history row
    `row` (fp32 [H])."""
    amax = fp8.amax_of(g)
    q, s = fp8.quantize_delayed(g, row, E5M2, amax)
    return q, q.T, amax, s


def swiglu_grad(dh, gate, up):
    """(d gate, d up) of h = swiglu(gate, up) (reference/activations.py) from dh, in gate's and up's dtype, as JAX
    differentiates it."""
    _, vjp = jax.vjp(activations.swiglu, gate, up)
    return vjp(dh.astype(gate.dtype))


def swiglu_grad_delayed(dh, gate, up, rows, h_scale):
    """SwiGLU's gradients quantised: dh, gate, up [M, F], rows fp32 [2, H] (gate's and up's gradient rows) and
    h_scale (the down product's input scale, fp32) -> (gate codes [M, F], their transpose, up codes, their transpose,
    amax |d gate|, amax |d up|, s gate, s up, h's e4m3 codes transposed [F, M], amax |h|): h = swiglu(gate, up) again,
    coded as the down product's forward coded it (`fp8.quantize_delayed`), in the layout its weight gradient reads,
    and its amax for the down product's input history, which the forward then need not measure (under remat that
    measurement was a pass over gate and up of its own in the backward: 398 us a layer, Llama-1B on one H100)."""
    dg, du = swiglu_grad(dh, gate, up)
    qg, tg, ag, sg = cast_transpose_delayed(dg, rows[0])
    qu, tu, au, su = cast_transpose_delayed(du, rows[1])
    h = swiglu_rounded(gate, up)
    hq = codes(h, h_scale, E4M3)  # the codes quantize_delayed gave it, at its scale
    return qg, tg, qu, tu, ag, au, sg, su, hq.T, fp8.amax_of(h)


def swiglu_rounded(gate, up):
    """swiglu(gate, up) as fp32 values rounded to gate's dtype, as `activations.swiglu` returns them, whatever XLA's
    `xla_allow_excess_precision` (on, it may skip that rounding where an fp32 use follows in the same fusion, so
    h's amax and codes would differ between the forward and a recomputation fused otherwise)."""
    info = jnp.finfo(gate.dtype)
    h = activations.swiglu(gate, up).astype(jnp.float32)
    return jax.lax.reduce_precision(h, exponent_bits=info.nexp, mantissa_bits=info.nmant)

