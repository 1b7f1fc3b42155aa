"""fp8 products with per-block scaling, `numerics.default: fp8_e4m3 @scale(per_block(N))` (DeepSeek-V3 style): a
dense product (`block_einsum`) and the experts' grouped one (`ragged_blocked`). reference/fp8.py's `einsum` and
`ragged_dot` hand a per_block scaling here; the per-tensor and delayed recipes are there."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tessera.lower.reference.fp8_scale import E4M3, E5M2, codes, pow2_scale, split_spec


# ---- per-block scaling: `numerics.default: fp8_e4m3 @scale(per_block(N))` (DeepSeek-V3 style) ------------------
#
# A product x ⊗ w is brought to the matrix form x2 [M, K] ⊗ w2 [K, F] (K: the contracted dims of the weight,
# flattened in the weight's order; F: its other dims; M: the activation's other dims), then
#
#   x2 is quantised to e4m3 in 1×N blocks along K  (scale sx[m, kb], one per row per K block),
#   w2 to e4m3 in N×N blocks                        (scale sw[kb, fb]),
#   y[m, f] = Σ_kb  (Σ_{k ∈ kb} xq[m, k] · wq[k, f]) / (sx[m, kb] · sw[kb, fb(f)])
#
# each block's product accumulating in fp32, multiplied by its two scales and added to the sum over K blocks in
# ascending kb (a fixed order: deterministic). Scales are powers of two, 2^floor(log2(max / amax_block)) as
# `quantize` takes them per tensor, so rescaling is exact and only the fp8 rounding (and fp32 sums) differ
# from the exact product. An all-zero block gets scale 1.
#
# The backward quantises the incoming gradient g [M, F] ONCE, to e5m2 in 1×N blocks along F (scale sg[m, fb]):
#   dx[m, k] = Σ_fb (Σ_{f ∈ fb} gq[m, f] · wq[k, f]) / (sg[m, fb] · sw[kb(k), fb])  — F is dx's contraction, so
#              these are the same blocked products as the forward's, reusing wq;
#   dw[k, f] = Σ_m (xq[m, k] / sx[m, kb]) · (gq[m, f] / sg[m, fb])                 — dw contracts over the rows M,
#              along which both operands' scales vary per row: the forward's xq and the gradient's gq are
#              rescaled exactly (powers of two) and multiplied in fp32. Quantising g a second time in N×1 blocks
#              along M would need the token count M to be a multiple of N, which nothing guarantees.
# The result is stored in the requested type (rounded once from the fp32 sum). Narrow @accum types are refused
# at check for per-block scaling (tessera/ir/check.py): each block's product accumulates in fp32.


def block_of(scaling) -> int | None:
    """N of a `per_block(N)` scaling string (LowerCtx.fp8), else None."""
    if isinstance(scaling, str) and scaling.startswith("per_block(") and scaling.endswith(")"):
        return int(scaling[len("per_block("):-1])
    return None




def quantize_rows(x, n: int, dtype):
    """x [M, K] in 1×n blocks along K: (x_q [M, K] in `dtype`, s [M, K // n]); x ≈ x_q / s blockwise."""
    m, k = x.shape
    xb = x.astype(jnp.float32).reshape(m, k // n, n)
    s = pow2_scale(jnp.max(jnp.abs(xb), axis=-1), dtype)
    return codes(xb, s[..., None], dtype).reshape(m, k), s


def quantize_tiles(w, n: int, dtype):
    """w [K, F] in n×n blocks: (w_q [K, F] in `dtype`, s [K // n, F // n]); w ≈ w_q / s blockwise."""
    k, f = w.shape
    wb = w.astype(jnp.float32).reshape(k // n, n, f // n, n)
    s = pow2_scale(jnp.max(jnp.abs(wb), axis=(1, 3)), dtype)
    return codes(wb, s[:, None, :, None], dtype).reshape(k, f), s


def _blocked_product(aq, sa, bq, sb, n: int):
    """Σ_kb (aq[:, kb] ⊗ bq[kb, :]) / (sa[:, kb] · sb[kb, fb]) in fp32: aq [M, K] with row-block scales sa [M, KB],
    bq [K, F] with tile scales sb [KB, F // n]; the K blocks added in ascending order."""
    m, k = aq.shape
    f = bq.shape[1]
    y = jnp.zeros((m, f), jnp.float32)
    for kb in range(k // n):
        part = jnp.einsum("mk,kf->mf", aq[:, kb * n:(kb + 1) * n], bq[kb * n:(kb + 1) * n, :],
                          preferred_element_type=jnp.float32)
        inv = 1.0 / (sa[:, kb][:, None] * jnp.repeat(sb[kb], n)[None, :])  # powers of two: exact
        y = y + part * inv
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _blocked(x2, w2, n, out_dtype):
    (xq, sx), (wq, sw) = quantize_rows(x2, n, E4M3), quantize_tiles(w2, n, E4M3)
    return _blocked_product(xq, sx, wq, sw, n).astype(out_dtype)


def _blocked_fwd(x2, w2, n, out_dtype):
    (xq, sx), (wq, sw) = quantize_rows(x2, n, E4M3), quantize_tiles(w2, n, E4M3)
    zx, zw = jnp.zeros((0,), x2.dtype), jnp.zeros((0,), w2.dtype)
    return _blocked_product(xq, sx, wq, sw, n).astype(out_dtype), (xq, sx, wq, sw, zx, zw)


def _blocked_bwd(n, out_dtype, res, g):
    xq, sx, wq, sw, zx, zw = res
    gq, sg = quantize_rows(g, n, E5M2)
    dx = _blocked_product(gq, sg, wq.T, sw.T, n)  # contracting F: the gradient's row blocks meet w's tiles
    xd = xq.astype(jnp.float32) * jnp.repeat(1.0 / sx, n, axis=1)  # exact: power-of-two rescaling
    gd = gq.astype(jnp.float32) * jnp.repeat(1.0 / sg, n, axis=1)
    dw = jnp.einsum("mk,mf->kf", xd, gd, preferred_element_type=jnp.float32)
    return dx.astype(zx.dtype), dw.astype(zw.dtype)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def block_einsum(spec: str, x, w, n: int, *, preferred_element_type=None):
    """x (activations) ⊗ w (a weight) with per-block scaling in N = n blocks (see above); `spec` an einsum of two
    operands whose every dim is either contracted or kept by one operand (no batch dims shared with the weight).
    The contracted size and the weight's kept size must be multiples of n (tessera check says so first)."""
    spec = spec.replace(" ", "")
    a, b, o = split_spec(spec)
    shared = [c for c in b if c in a and c in o]
    if shared:
        raise ValueError(f"per-block fp8 product {spec!r}: dims {shared} are batch dims of the weight")
    contract = [c for c in b if c in a and c not in o]
    keep_w = [c for c in b if c in o]
    keep_x = [c for c in a if c in o]
    size = {**dict(zip(a, x.shape)), **dict(zip(b, w.shape))}
    k = int(np.prod([size[c] for c in contract], dtype=np.int64))
    f = int(np.prod([size[c] for c in keep_w], dtype=np.int64))
    m = int(np.prod([size[c] for c in keep_x], dtype=np.int64))
    if k % n or f % n:
        raise ValueError(f"per-block fp8 product {spec!r}: contracted size {k} and weight's kept size {f} must be "
                         f"multiples of the block {n}")
    x2 = jnp.einsum(f"{a}->{''.join(keep_x + contract)}", x).reshape(m, k)
    w2 = jnp.einsum(f"{b}->{''.join(contract + keep_w)}", w).reshape(k, f)
    out = jnp.dtype(preferred_element_type or x.dtype)
    y2 = _blocked(x2, w2, n, out)
    y = y2.reshape([size[c] for c in keep_x + keep_w])
    return jnp.einsum(f"{''.join(keep_x + keep_w)}->{o}", y)


# ---- per-block scaling of the experts' grouped product: lhs [M, K] (rows grouped by expert), rhs [G, K, F] ---------
#
# The tokens are quantised to e4m3 in 1×N blocks along K (as a dense product's activations), each expert's matrix
# in N×N blocks (scales [G, K/N, F/N]). Each K block's grouped product accumulates in fp32 and the blocks are added
# in ascending order; the weight tiles' scales are applied to the codes before the product and the rows' after it
# (powers of two both: the same numbers as scaling each block's product by both). The backward quantises the
# incoming gradient once to e5m2 in 1×N blocks along F; both gradients are the grouped products (transposed) of the
# exactly rescaled codes — the forward's and the gradient's — accumulating in fp32.


def _expand(s, n: int, axes):
    for a in axes:
        s = jnp.repeat(s, n, axis=a)
    return s


def _ragged_blocked_y(lq, sl, rd, group_sizes, n: int):
    m, k = lq.shape
    y = jnp.zeros((m, rd.shape[2]), jnp.float32)
    for kb in range(k // n):
        part = jax.lax.ragged_dot(lq[:, kb * n:(kb + 1) * n].astype(jnp.float32), rd[:, kb * n:(kb + 1) * n, :],
                                  group_sizes, preferred_element_type=jnp.float32)
        y = y + part * (1.0 / sl[:, kb])[:, None]
    return y


def _ragged_quantize(lhs, rhs, n: int):
    (lq, sl) = quantize_rows(lhs, n, E4M3)
    g, k, f = rhs.shape
    rb = rhs.astype(jnp.float32).reshape(g, k // n, n, f // n, n)
    sr = pow2_scale(jnp.max(jnp.abs(rb), axis=(2, 4)), E4M3)
    rq = codes(rb, sr[:, :, None, :, None], E4M3).reshape(g, k, f)
    rd = rq.astype(jnp.float32) * _expand(1.0 / sr, n, (1, 2))  # exact: powers of two
    return lq, sl, rd


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def ragged_blocked(lhs, rhs, group_sizes, n, out_dtype):
    lq, sl, rd = _ragged_quantize(lhs, rhs, n)
    return _ragged_blocked_y(lq, sl, rd, group_sizes, n).astype(out_dtype)


def _ragged_blocked_fwd(lhs, rhs, group_sizes, n, out_dtype):
    lq, sl, rd = _ragged_quantize(lhs, rhs, n)
    out = _ragged_blocked_y(lq, sl, rd, group_sizes, n).astype(out_dtype)
    return out, (lq, sl, rd, group_sizes, jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))


def _ragged_blocked_bwd(n, out_dtype, res, g):
    lq, sl, rd, group_sizes, zl, zr = res
    gq, sg = quantize_rows(g, n, E5M2)
    ld = lq.astype(jnp.float32) * _expand(1.0 / sl, n, (1,))  # the forward's codes, rescaled exactly
    gd = gq.astype(jnp.float32) * _expand(1.0 / sg, n, (1,))
    _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes, preferred_element_type=jnp.float32), ld, rd)
    dl, dr = vjp(gd)
    return dl.astype(zl.dtype), dr.astype(zr.dtype), None


ragged_blocked.defvjp(_ragged_blocked_fwd, _ragged_blocked_bwd)
