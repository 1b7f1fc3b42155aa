"""fp8 contractions with per-tensor current scaling: `numerics.default: fp8_e4m3 @scale(per_tensor)`; delayed
scaling from an amax history, `fp8_e4m3 @scale(delayed(H))` (`_delayed` below); per-block scaling,
`fp8_e4m3 @scale(per_block(N))`, is reference/fp8_per_block.py's (`einsum` and `ragged_dot` hand it there).

The usual fp8 training recipe for the products of activations with weights (linear, attention's q/k/v/o
projections, the MLP's gate/up/down, the MoE experts' grouped products): both operands are quantised to e4m3 in the forward pass and the
incoming gradient to e5m2 in the backward pass, each with one scale per tensor taken from its current amax,
and the products of the quantised values accumulate in the `@accum` type (reference/accum.py for bf16/fp16):

    s_x = 2^floor(log2(max_e4m3 / amax|x|))       x_q = e4m3(x · s_x)   (a power of two, `fp8_scale.pow2_scale`: exact)
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
import math
from typing import Any

import jax
import jax.numpy as jnp

from tessera.lower.reference import accum as accum_ref
from tessera.lower.reference.fp8_per_block import block_einsum, block_of, ragged_blocked
from tessera.lower.reference.fp8_scale import E4M3, E5M2, amax_of, codes, pow2_scale, quantize, split_spec


# XLA:GPU runs an fp8 × fp8 dot at DEFAULT precision with cuBLASLt's "fast accumulation" (Hopper's fp8 tensor-core
# accumulator, which keeps fewer bits than fp32); any other precision keeps the full fp32 accumulator. The usual
# recipe (Transformer Engine, torchtitan) takes fast accumulation in the forward products only: the gradient
# products contract over every token of the batch (K = 16,384 in the Llama-1B bench step), where the short
# accumulator's error grows. The backward products below pass HIGHEST; the CPU, accumulating exactly, ignores it.
PRECISE = jax.lax.Precision.HIGHEST


def scaled_product(spec, a_q, b_q, scale, accum, out_dtype, precision=None):
    if accum_ref.narrow(accum):  # the blocked narrow accumulation, on the fp8 values widened (exactly) to bf16
        y = accum_ref.einsum(spec, a_q.astype(jnp.bfloat16), b_q.astype(jnp.bfloat16), accum=accum,
                             preferred_element_type=jnp.float32)
    elif jnp.dtype(out_dtype) == jnp.bfloat16:
        # XLA gets the fp8 operands themselves, accumulating in fp32 and storing bf16 (the CPU widens them:
        # exact). bf16 has fp32's exponent range and the scale is a power of two, so rounding before the
        # division is bitwise rounding after it; and the product a remat policy saves is the bf16 one: an
        # fp32 result held for the backward doubled the saved matmul outputs (the Llama-1B bench step ran
        # out of memory on an H100, a 35.4 GiB temporary).
        y = jnp.einsum(spec, a_q, b_q, preferred_element_type=jnp.bfloat16, precision=precision)
        return y / scale.astype(jnp.bfloat16)
    else:  # fp32 (or fp16, whose range the unscaled product may pass) results from the fp32 accumulator
        y = jnp.einsum(spec, a_q, b_q, preferred_element_type=jnp.float32, precision=precision)
    return (y / scale).astype(out_dtype)




@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _einsum(spec, x, w, accum, out_dtype):
    return _fwd(spec, x, w, accum, out_dtype)[0]


def _fwd(spec, x, w, accum, out_dtype):  # the held weight's forward (below), w quantised here
    wq, sw = quantize(w, E4M3)
    return _held_fwd(spec, "", x, w, wq, sw, wq, accum, out_dtype)


def _bwd(spec, accum, out_dtype, res, g):
    xq, sx, wq, sw, zx, zw = res
    a, b, o = split_spec(spec)
    gq, sg = quantize(g, E5M2)
    dx = scaled_product(f"{o},{b}->{a}", gq, wq, sg * sw, accum, zx.dtype, PRECISE)
    dw = scaled_product(f"{a},{o}->{b}", xq, gq, sx * sg, accum, zw.dtype, PRECISE)
    return dx, dw


_einsum.defvjp(_fwd, _bwd)


def einsum(spec: str, x, w, *, accum, preferred_element_type=None, scaling: str | None = "per_tensor",
           history=None, held=None, cast=None, x_row=None):
    """x (activations) ⊗ w (a weight) as the module doc says; the result in preferred_element_type (default x's).
    `scaling` (LowerCtx.fp8): "per_tensor", "per_block(N)" for the blocked products below, or "delayed(H)" with
    `history` this product's amax history (fp32 [3, H]: delayed scaling below; without one, as per_tensor).
    `held`: w already quantised as this product would quantise it (`hold`, LowerCtx.fp8_held), the same numbers
    without the product reading w itself; its gradient still goes to w. A fourth element (w_q with its contracted
    dims last, `hold`'s `lead`) is what the forward product then reads. `cast`: under delayed scaling, an
    implementation of `reference.fp8_cast.cast_transpose_delayed` (a kernel) the backward quantises the output
    gradient with, writing the transposed codes the weight gradient reads; None: quantised here (the same codes).
    `x_row`: under delayed scaling, the row x is scaled from in place of history[0]: another product's input row
    recording the same amaxes (the same x, every step), so that the products of one x cast it once (XLA merges equal
    casts, in the forward and in the backward's recomputation); this product's amaxes still go to its own history."""
    n = block_of(scaling)
    if n is not None:
        return block_einsum(spec, x, w, n, preferred_element_type=preferred_element_type)
    out = jnp.dtype(preferred_element_type or x.dtype)
    delayed = history is not None and delayed_of(scaling) is not None
    if cast is not None and (not delayed or gradient_matrix(spec, x.shape, w.shape) is None):
        cast = None
    if delayed:
        x_row = history[0] if x_row is None else jax.lax.stop_gradient(x_row)
        if x_row.shape != history.shape[1:]:
            raise ValueError(f"x's row {x_row.shape} is not a row of the history {history.shape}")
    if held is not None:
        wq, sw, aw = held[:3]
        spec = spec.replace(" ", "")
        fspec, wt = forward_operand(spec, held)
        if delayed:
            return _delayed_held(spec, fspec, x, w, wq, sw, aw, wt, history, x_row, jnp.dtype(accum), out, cast)
        return _einsum_held(spec, fspec, x, w, wq, sw, wt, jnp.dtype(accum), out)
    if delayed:
        return _delayed(spec.replace(" ", ""), x, w, history, x_row, jnp.dtype(accum), out, cast)
    return _einsum(spec.replace(" ", ""), x, w, jnp.dtype(accum), out)


# ---- weights quantised before their products (LowerCtx.fp8_held, tessera/lower/fp8_held.py) --------------------
#
# A repeat's stacked weights can be quantised once, before its scan, instead of in each layer's product: then a train
# step reads each fp32 weight once for its fp8 copy, where a product inside the scan quantised its slice in the
# forward and again in the backward (remat replays a product's quantisation: its residuals are not values a
# checkpoint policy sees), and XLA:GPU transposed each fp32 stack whole to the layout cuBLASLt's fp8 GEMM takes
# before either. `hold` is `quantize` (`quantize_delayed` with the history's weight row) of one weight plus its amax;
# the products below take it in place of quantising w: the same numbers, w's gradient as `_bwd` computes it, and
# none for the held copy (stop_gradient before the scan; zeros here).


def hold(w, dtype, history=None, lead: int | None = None):
    """(w_q, s, amax|w|) of one weight `w` cast to `dtype` (its product's compute type) as the product would take
    it: `quantize`, or with `history` (delayed scaling's [3, H]) `quantize_delayed` from its weight row. With `lead`
    (the number of leading dims its forward product contracts) a fourth: w_q with those dims moved last, the
    layout cuBLASLt's fp8 GEMM reads (contracted dims minor), so a forward product reading it inside a loop does
    not transpose w_q there on every iteration (`_forward`); the backward's product reads w_q as it is."""
    w = w.astype(dtype)
    wq, sw = quantize(w, E4M3) if history is None else quantize_delayed(w, history[1], E4M3)
    if lead is None:
        return wq, sw, amax_of(w)
    return wq, sw, amax_of(w), jnp.moveaxis(wq, tuple(range(lead)), tuple(range(wq.ndim - lead, wq.ndim)))


def _forward(spec: str, wq, wt) -> str:
    """The forward product's spec over `wt` (the held w_q with its leading contracted dims moved last, `hold`),
    where `wt` is that for `spec`; else "" (the product reads w_q)."""
    if wt is None:
        return ""
    a, b, o = split_spec(spec)
    k = len(b) - len(b.lstrip("".join(c for c in b if c not in o)))  # leading contracted dims
    if not 0 < k < len(b) or any(c not in o for c in b[k:]) or wt.shape != wq.shape[k:] + wq.shape[:k]:
        return ""
    return f"{a},{b[k:] + b[:k]}->{o}"


def forward_operand(spec: str, held) -> tuple[str, Any]:
    """(fspec, operand) of a forward product `spec` over a held weight (`hold`'s tuple): its fourth element, the
    layout cuBLASLt reads, with `_forward`'s spec over it, where that applies; else ("", w_q)."""
    wq, wt = held[0], (held[3] if len(held) > 3 else None)
    fspec = _forward(spec, wq, wt)
    return fspec, (wt if fspec else wq)


# `fspec`: the forward product's spec over `wt` (`_forward`), or "" for w_q itself (then `wt` is w_q)
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 7, 8))
def _einsum_held(spec, fspec, x, w, wq, sw, wt, accum, out_dtype):
    return _held_fwd(spec, fspec, x, w, wq, sw, wt, accum, out_dtype)[0]


def _held_fwd(spec, fspec, x, w, wq, sw, wt, accum, out_dtype):
    xq, sx = quantize(x, E4M3)
    zx, zw = jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype)  # carry the operands' dtypes, not their values
    return scaled_product(fspec or spec, xq, wt, sx * sw, accum, out_dtype), (xq, sx, wq, sw, zx, zw)


def _held_bwd(spec, fspec, accum, out_dtype, res, g):  # the held copies take no gradient (None: zeros)
    dx, dw = _bwd(spec, accum, out_dtype, res, g)
    return dx, dw, jnp.zeros_like(res[2]), jnp.zeros_like(res[3]), None


_einsum_held.defvjp(_held_fwd, _held_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 10, 11, 12))
def _delayed_held(spec, fspec, x, w, wq, sw, aw, wt, history, x_row, accum, out_dtype, cast):
    return _delayed_held_fwd(spec, fspec, x, w, wq, sw, aw, wt, history, x_row, accum, out_dtype, cast)[0]


def _delayed_held_fwd(spec, fspec, x, w, wq, sw, aw, wt, history, x_row, accum, out_dtype, cast=None):
    seen = jnp.stack([amax_of(x), aw])
    xq, sx = quantize_delayed(x, x_row, E4M3)
    zx, zw = jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype)
    return scaled_product(fspec or spec, xq, wt, sx * sw, accum, out_dtype), (xq, sx, wq, sw, zx, zw, history, seen)


def _delayed_held_bwd(spec, fspec, accum, out_dtype, cast, res, g):
    dx, dw, dh = _delayed_bwd(spec, accum, out_dtype, cast, res, g)
    wq, sw, history = res[2], res[3], res[6]
    zeros = jnp.zeros_like
    return dx, dw, zeros(wq), zeros(sw), jnp.zeros((), jnp.float32), None, dh, zeros(history[0])


_delayed_held.defvjp(_delayed_held_fwd, _delayed_held_bwd)


# ---- delayed scaling: `numerics.default: fp8_e4m3 @scale(delayed(H))` (Transformer Engine's recipe) --------------
#
# Each product carries an amax history `h` (fp32 [3, H]; rows: the activation x, the weight w, the output gradient
# g; column 0 the newest step). The scale of an operand is per_tensor's power of two taken from the max of its row,
# known before the step's operand is (margin 0), so quantising needs no reduction over the operand first:
#
#     s_x = 2^floor(log2(max_e4m3 / max h[0]))      x_q = e4m3(clip(x · s_x, ±max_e4m3))   (saturating)
#
# and likewise w (row 1, e4m3) and, in the backward pass, g (row 2, e5m2). A row whose max is 0 — an empty history
# (the first step) or one of all-zero tensors — carries no range: x is scaled by 1, g by its current amax
# (`quantize_delayed`), and w's row starts from the initial weight's amax (fp8_delayed.seeded), so a first step
# scales weights and gradients as per_tensor does and inputs by 1. The step's own amaxes |x|, |w|, |g| are
# measured beside the product and handed back as the "gradient" of `h`: zeros but column 0 = [amax x, amax w,
# amax g] (Flax's fp8 ops do the same). The train step (tessera/lower/fp8_delayed.py) takes that cotangent — the
# max over canonical shards and microbatches, not the sum — and pushes it into the history it keeps in the
# optimizer state. Everything else (the products, their rescaling, the backward's reuse of the forward's quantised
# operands) is per_tensor's.


def delayed_of(scaling) -> int | None:
    """H of a `delayed(H)` scaling string (LowerCtx.fp8), else None."""
    if isinstance(scaling, str) and scaling.startswith("delayed(") and scaling.endswith(")"):
        return int(scaling[len("delayed("):-1])
    return None


def quantize_delayed(x, row, dtype, fallback=None):
    """(x_q, s): x quantised to `dtype` with the power of two from max(row) (an amax history's row), saturating. A
    row of zeros only (no step recorded yet) scales by `fallback`'s power of two where given (the gradient's current
    amax, which its product measures anyway for the history), else by 1 (Transformer Engine's initial scale).

    The scale depends on the history alone wherever it can: then nothing reduces over x before its cast, and XLA
    fuses the cast into x's producer (the amax for the history is measured in the same pass). On one H100 (jax 0.11.2,
    the Llama-1B shape, batch 8 x 2048, delayed(16); session 33, one device call): every operand falling back to its
    current amax through a select took 264.0 ms a step (a `lax.cond` instead: 273.9 in session 31, whose conditional
    reads its predicate back to the host), inputs and weights from the history alone 249.9, all three 244.7. The
    gradient keeps its fallback: at scale 1 a step-1 gradient underflows e5m2 (smallest subnormal 2^-16; a mean
    loss's gradients over 16k tokens lie far below), and after 9 steps learning one batch the loss was 2.75 against
    0.26-0.29 with it. The weights' rows start from the initial weights' amaxes (`fp8_delayed.carrying`), so a
    step-1 weight scales as per_tensor's; a step-1 input scales by 1."""
    s = delayed_scale(row, dtype, fallback)
    return codes(x, s, dtype), s


def known(row):
    """Whether an amax history row holds a range (its max positive and finite): then the scale comes from it alone."""
    past = jnp.max(row)
    return (past > 0) & jnp.isfinite(past)


def delayed_scale(row, dtype, fallback=None):
    """`quantize_delayed`'s scale: from max(row), or while it holds no range from `fallback` (an amax), else 1."""
    past = jnp.max(row)
    return pow2_scale(past if fallback is None else jnp.where(known(row), past, fallback), dtype)


def record(history, amaxes):
    """The cotangent of a history: zeros, column 0 the step's amaxes [3]."""
    return jnp.zeros_like(history).at[:, 0].set(amaxes.astype(history.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6, 7))
def _delayed(spec, x, w, history, x_row, accum, out_dtype, cast):
    return _delayed_fwd(spec, x, w, history, x_row, accum, out_dtype, cast)[0]


def _delayed_fwd(spec, x, w, history, x_row, accum, out_dtype, cast):  # the held weight's forward (above)
    wq, sw, aw = hold(w, w.dtype, history)
    return _delayed_held_fwd(spec, "", x, w, wq, sw, aw, wq, history, x_row, accum, out_dtype)


def _delayed_bwd(spec, accum, out_dtype, cast, res, g):
    xq, sx, wq, sw, zx, zw, history, seen = res
    a, b, o = split_spec(spec)
    gq, gspec, gt, ag, sg = cast_gradient(cast, o, a, b, g, history[2])
    dx = scaled_product(f"{o},{b}->{a}", gq, wq, sg * sw, accum, zx.dtype, PRECISE)
    dw = scaled_product(f"{a},{gspec}->{b}", xq, gt, sx * sg, accum, zw.dtype, PRECISE)
    return dx, dw, record(history, jnp.concatenate([seen, ag[None]]))


def _delayed_plain_bwd(spec, accum, out_dtype, cast, res, g):  # x's row takes no gradient
    return *_delayed_bwd(spec, accum, out_dtype, cast, res, g), jnp.zeros_like(res[6][0])


_delayed.defvjp(_delayed_fwd, _delayed_plain_bwd)


def cast_gradient(cast, o: str, a: str, b: str, g, row):
    """A product's output gradient g (letters `o` of its einsum `a,b->o`) quantised by `cast` (an implementation of
    `cast_transpose_delayed`) over its matrix [tokens, outputs]: the tokens are o's leading letters, those it shares
    with the activation `a` and not the weight `b`. Returns (codes shaped as g, the transposed codes' letters
    (outputs, then tokens), those codes, amax, scale). `gradient_matrix` says where this applies. `cast` None: the
    codes quantised here, as they are (their letters `o`; the weight gradient's GEMM transposes them)."""
    if cast is None:
        amax = amax_of(g)
        q, s = quantize_delayed(g, row, E5M2, amax)
        return q, o, q, amax, s
    tokens = len(o) - len(o.lstrip(a.translate({ord(c): None for c in b})))
    m = math.prod(g.shape[:tokens])
    q, t, amax, s = cast(g.reshape(m, -1), row)
    return q.reshape(g.shape), o[tokens:] + o[:tokens], t.reshape(g.shape[tokens:] + g.shape[:tokens]), amax, s


def gradient_matrix(spec: str, x_shape, w_shape) -> tuple[int, int] | None:
    """[tokens, outputs] of the output gradient of x ⊗ w (`spec`, a weight product a,b->o) as `cast_gradient` reads
    it, or None where o does not lead with the tokens (the dims of x that w lacks) followed by w's kept dims."""
    ins, o = spec.replace(" ", "").split("->")
    a, b = ins.split(",")
    tokens = [c for c in a if c not in b]
    kept = [c for c in b if c not in a]
    if list(o) != tokens + kept or not tokens or not kept:
        return None
    sizes = {**dict(zip(a, x_shape)), **dict(zip(b, w_shape))}
    return math.prod(sizes[c] for c in tokens), math.prod(sizes[c] for c in kept)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ragged_delayed(lhs, rhs, group_sizes, history, accum, out_dtype):
    return _ragged_delayed_fwd(lhs, rhs, group_sizes, history, accum, out_dtype)[0]


def _ragged_delayed_fwd(lhs, rhs, group_sizes, history, accum, out_dtype):
    seen = jnp.stack([amax_of(lhs), amax_of(rhs)])
    (lq, sl), (rq, sr) = quantize_delayed(lhs, history[0], E4M3), quantize_delayed(rhs, history[1], E4M3)
    out = (_ragged(lq, rq, group_sizes, accum) / (sl * sr)).astype(out_dtype)
    return out, (lq, sl, rq, sr, group_sizes, jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype), history, seen)


def _ragged_delayed_bwd(accum, out_dtype, res, g):
    lq, sl, rq, sr, group_sizes, zl, zr, history, seen = res
    ag = amax_of(g)
    gq, sg = quantize_delayed(g, history[2], E5M2, ag)
    wide = jnp.bfloat16
    _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes, preferred_element_type=jnp.float32),
                     lq.astype(wide), rq.astype(wide))
    dl, dr = vjp(gq.astype(jnp.float32))
    return (dl.astype(jnp.float32) / (sg * sr)).astype(zl.dtype), (dr.astype(jnp.float32) / (sl * sg)).astype(zr.dtype), \
        None, record(history, jnp.concatenate([seen, ag[None]]))


_ragged_delayed.defvjp(_ragged_delayed_fwd, _ragged_delayed_bwd)


def ragged_dot(lhs, rhs, group_sizes, preferred_element_type=None, accum=None, scaling: str | None = "per_tensor",
               history=None):
    """The experts' grouped product with e4m3 operands (one scale for the tokens, one for all experts' weights) and
    e5m2 gradients, as `einsum` for dense products; the result in preferred_element_type (default lhs's dtype).
    Under "delayed(H)" with `history` (fp32 [3, H]) the scales come from the history, as `einsum`'s."""
    out = jnp.dtype(preferred_element_type or lhs.dtype)
    n = block_of(scaling)
    if n is not None:
        if accum is not None and jnp.dtype(accum) != jnp.float32:
            raise NotImplementedError("per-block fp8 accumulates in fp32 (tessera check refuses a narrow @accum)")
        return ragged_blocked(lhs, rhs, group_sizes, n, out)
    accum = jnp.dtype(accum if accum is not None else jnp.float32)
    if history is not None and delayed_of(scaling) is not None:
        return _ragged_delayed(lhs, rhs, group_sizes, history, accum, out)
    return _ragged_dot(lhs, rhs, group_sizes, accum, out)
