"""fp8 contractions with per-tensor current scaling: `numerics.default: fp8_e4m3 @scale(per_tensor)`.

The usual fp8 training recipe for the products of activations with weights (linear, attention's q/k/v/o
projections, the MLP's gate/up/down, the MoE experts' grouped products): both operands are quantised to e4m3 in the forward pass and the
incoming gradient to e5m2 in the backward pass, each with one scale per tensor taken from its current amax,
and the products of the quantised values accumulate in the `@accum` type (reference/accum.py for bf16/fp16):

    s_x = 2^floor(log2(max_e4m3 / amax|x|))       x_q = e4m3(x · s_x)   (a power of two: x · s_x is exact)
    y   = (x_q ⊗ w_q) / (s_x · s_w)               accumulated in @accum, stored in the result type
    dx  = (g_q ⊗ w_qᵀ) / (s_g · s_w),  dw = (x_qᵀ ⊗ g_q) / (s_x · s_g),   g_q = e5m2(g · s_g)

The backward reuses the forward's quantised operands (which is also what it keeps: one byte per element).
Everything else — activations between ops, norms, softmax, the loss, the unembedding, attention's q·k and
p·v — runs in bf16 (the program's compute type under this policy), and master weights stay as `params` says.

The dense products hand XLA the fp8 operands themselves with an fp32 result (XLA:CPU widens them, exactly: an
exact emulation of fp8 × fp8 → fp32 that CI tests); whether a GPU backend then runs an fp8 tensor-core GEMM is
unmeasured. Under a narrow @accum, and in the grouped products, the fp8 values are widened to bf16 (exact: every
e4m3 and e5m2 value is a bf16 value) and multiplied as reference/accum.py and `ragged_dot` do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tessera.lower.reference import accum as accum_ref

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def quantize(x, dtype):
    """(x_q in fp8 `dtype`, s): x scaled by the power of two s that brings amax|x| just under the format's
    largest value, rounded to fp8 (saturating); x ≈ x_q / s. An all-zero x gets s = 1."""
    xf = x.astype(jnp.float32)
    big = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(xf))
    exp = jnp.floor(jnp.log2(big / jnp.where(amax > 0, amax, 1.0)))
    s = jnp.where((amax > 0) & jnp.isfinite(amax), jnp.exp2(exp), 1.0)
    return jnp.clip(xf * s, -big, big).astype(dtype), s


def _product(spec, a_q, b_q, scale, accum, out_dtype):
    if accum_ref.narrow(accum):  # the blocked narrow accumulation, on the fp8 values widened (exactly) to bf16
        y = accum_ref.einsum(spec, a_q.astype(jnp.bfloat16), b_q.astype(jnp.bfloat16), accum=accum,
                             preferred_element_type=jnp.float32)
    elif jnp.dtype(out_dtype) == jnp.bfloat16:
        # XLA gets the fp8 operands themselves, accumulating in fp32 and storing bf16 (the CPU widens them:
        # exact). bf16 has fp32's exponent range and the scale is a power of two, so rounding before the
        # division is bitwise rounding after it; and the product a remat policy saves is the bf16 one: an
        # fp32 result held for the backward doubled the saved matmul outputs (the Llama-1B bench step ran
        # out of memory on an H100, a 35.4 GiB temporary).
        y = jnp.einsum(spec, a_q, b_q, preferred_element_type=jnp.bfloat16)
        return y / scale.astype(jnp.bfloat16)
    else:  # fp32 (or fp16, whose range the unscaled product may pass) results from the fp32 accumulator
        y = jnp.einsum(spec, a_q, b_q, preferred_element_type=jnp.float32)
    return (y / scale).astype(out_dtype)


def _split(spec: str):
    ins, out = spec.split("->")
    a, b = ins.split(",")
    return a, b, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _einsum(spec, x, w, accum, out_dtype):
    (xq, sx), (wq, sw) = quantize(x, E4M3), quantize(w, E4M3)
    return _product(spec, xq, wq, sx * sw, accum, out_dtype)


def _fwd(spec, x, w, accum, out_dtype):
    (xq, sx), (wq, sw) = quantize(x, E4M3), quantize(w, E4M3)
    zx, zw = jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype)  # carry the operands' dtypes, not their values
    return _product(spec, xq, wq, sx * sw, accum, out_dtype), (xq, sx, wq, sw, zx, zw)


def _bwd(spec, accum, out_dtype, res, g):
    xq, sx, wq, sw, zx, zw = res
    a, b, o = _split(spec)
    gq, sg = quantize(g, E5M2)
    dx = _product(f"{o},{b}->{a}", gq, wq, sg * sw, accum, zx.dtype)
    dw = _product(f"{a},{o}->{b}", xq, gq, sx * sg, accum, zw.dtype)
    return dx, dw


_einsum.defvjp(_fwd, _bwd)


def einsum(spec: str, x, w, *, accum, preferred_element_type=None):
    """x (activations) ⊗ w (a weight) as the module doc says; the result in preferred_element_type (default x's)."""
    out = jnp.dtype(preferred_element_type or x.dtype)
    return _einsum(spec.replace(" ", ""), x, w, jnp.dtype(accum), out)


# ---- the experts' grouped product (`ragged_dot`: lhs [M, K] rows grouped by group_sizes, rhs [G, K, N]) --------

def _ragged(lhs, rhs, group_sizes, accum):
    wide = jnp.bfloat16
    return accum_ref.ragged_dot(lhs.astype(wide), rhs.astype(wide), group_sizes, accum=accum,
                                preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ragged_dot(lhs, rhs, group_sizes, accum, out_dtype):
    (lq, sl), (rq, sr) = quantize(lhs, E4M3), quantize(rhs, E4M3)
    return (_ragged(lq, rq, group_sizes, accum) / (sl * sr)).astype(out_dtype)


def _ragged_fwd(lhs, rhs, group_sizes, accum, out_dtype):
    (lq, sl), (rq, sr) = quantize(lhs, E4M3), quantize(rhs, E4M3)
    out = (_ragged(lq, rq, group_sizes, accum) / (sl * sr)).astype(out_dtype)
    return out, (lq, sl, rq, sr, group_sizes, jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))


def _ragged_bwd(accum, out_dtype, res, g):
    lq, sl, rq, sr, group_sizes, zl, zr = res
    gq, sg = quantize(g, E5M2)
    wide = jnp.bfloat16
    # the transposed grouped products of the fp8 operands (exact in bf16), each accumulating in fp32
    _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes, preferred_element_type=jnp.float32),
                     lq.astype(wide), rq.astype(wide))
    dl, dr = vjp(gq.astype(jnp.float32))
    return (dl.astype(jnp.float32) / (sg * sr)).astype(zl.dtype), (dr.astype(jnp.float32) / (sl * sg)).astype(zr.dtype), \
        None


_ragged_dot.defvjp(_ragged_fwd, _ragged_bwd)


def ragged_dot(lhs, rhs, group_sizes, preferred_element_type=None, accum=None):
    """The experts' grouped product with e4m3 operands (one scale for the tokens, one for all experts' weights) and
    e5m2 gradients, as `einsum` for dense products; the result in preferred_element_type (default lhs's dtype)."""
    out = jnp.dtype(preferred_element_type or lhs.dtype)
    return _ragged_dot(lhs, rhs, group_sizes, jnp.dtype(accum if accum is not None else jnp.float32), out)
