"""The MLP's gate and up products and SwiGLU under delayed fp8 scaling as one custom VJP, so that SwiGLU's backward
and the quantisation of its two gradients are one pass (the lowering table's `swiglu_grad_delayed`: a kernel on a
GPU, tessera/lower/kernels/fp8_cast.py; its reference elsewhere).

Built from the products alone (reference/fp8.py), JAX differentiates SwiGLU and hands each gradient to its
product's custom VJP, which takes its amax (the history's record, and the scale while the history is empty) and
quantises it; the weight gradient's GEMM then reads the codes token-minor (cuBLASLt's fp8 GEMMs take both operands
contiguous along K), so XLA:GPU transposes them too. At the Llama-1B shape (16,384 tokens x 8,192, one H100,
session 45's profile) that was a pass for the amaxes and one multi-output fusion of 1,165 us a layer, ~2.5x its
bytes' time. Here the backward asks for both gradients' codes in both layouts, their amaxes and scales at once.

The numbers are the built products' (the CPU runs both bit for bit: tests/lower/test_fp8_mlp.py): the forward
quantises x once, by gate's input row (up's records the same amaxes, x's, every step, so the two rows are equal),
and makes gate and up with the same fp8 products; the backward's products are the built backward's, the weight
gradient's reading the transposed codes. Where it does not apply (another scaling, biases, GPT-OSS's clamped
SwiGLU, a sharded or deterministic-tp MLP, a narrow accumulator) the products run one by one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tessera.ir.registry import struct_fields
from tessera.lower import table
from tessera.lower.fp8_held import held_of
from tessera.lower.reference import accum as accum_ref, activations, fp8
from tessera.lower.reference.fp8 import E4M3, PRECISE

PRIMITIVE = "swiglu_grad_delayed"


def applies(ctx, attrs, params: dict, x) -> bool:
    """Whether the MLP's gate, up and SwiGLU run as `gate_up` here."""
    act = attrs["act"]
    return (ctx.fp8 is not None and fp8.delayed_of(ctx.fp8) is not None and bool(ctx.fp8_history)
            and all(n in ctx.fp8_history for n in ("gate", "up")) and ctx.shard is None
            and ctx.tensor is None and "gate_bias" not in params
            and act.kind == "swiglu" and struct_fields(act).get("alpha") is None
            and not accum_ref.narrow(ctx.accum_dtype) and x.ndim == 3)


def gate_up(ctx, label: str, x, gate, up, out_dtype):
    """swiglu(x ⊗ gate, x ⊗ up) [b, s, f] in x's dtype, gate and up cast to x's dtype; the products' outputs in
    `out_dtype` (stored_dtype, as the built lowering's)."""
    f = gate.shape[-1]
    grad = jax.ShapeDtypeStruct((x.shape[0] * x.shape[1], f), x.dtype)
    rows = jax.ShapeDtypeStruct((2, ctx.fp8_history["gate"].shape[-1]), jnp.float32)
    choice, fn = table.choose(ctx, PRIMITIVE, grad, grad, grad, rows)
    if ctx.report is not None:
        ctx.report[f"{label}: SwiGLU's gradient to e5m2"] = choice
    history_g, history_u = ctx.fp8_history["gate"], ctx.fp8_history["up"]
    held = []
    for name, w, history in (("gate", gate, history_g), ("up", up, history_u)):
        h = held_of(ctx, name, x.dtype)
        h = fp8.hold(w, x.dtype, history) if h is None else h
        fspec, wt = fp8.forward_operand("bse,ef->bsf", h)
        held.append((h[0], h[1], h[2], wt, fspec))
    arrays = tuple(jax.lax.stop_gradient(a) for h in held for a in h[:4])
    return _gate_up(x, gate, up, arrays, history_g, history_u, jnp.dtype(ctx.accum_dtype), jnp.dtype(out_dtype),
                    fn, (held[0][4], held[1][4]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _gate_up(x, wg, wu, held, history_g, history_u, accum, out_dtype, grad_fn, fspecs):
    return _gate_up_fwd(x, wg, wu, held, history_g, history_u, accum, out_dtype, grad_fn, fspecs)[0]


def _gate_up_fwd(x, wg, wu, held, history_g, history_u, accum, out_dtype, grad_fn, fspecs):
    wqg, swg, awg, wtg, wqu, swu, awu, wtu = held
    ax = fp8.amax_of(x)
    xq, sx = fp8.quantize_delayed(x, history_g[0], E4M3)
    g = fp8.scaled_product(fspecs[0] or "bse,ef->bsf", xq, wtg, sx * swg, accum, out_dtype).astype(x.dtype)
    u = fp8.scaled_product(fspecs[1] or "bse,ef->bsf", xq, wtu, sx * swu, accum, out_dtype).astype(x.dtype)
    h = activations.swiglu(g, u)
    zx, zw = jnp.zeros((0,), x.dtype), jnp.zeros((0,), wg.dtype)  # the operands' dtypes, not their values
    return h, (xq, sx, wqg, swg, wqu, swu, g, u, history_g, history_u, jnp.stack([ax, awg, awu]), zx, zw)


def _gate_up_bwd(accum, out_dtype, grad_fn, fspecs, res, dh):
    xq, sx, wqg, swg, wqu, swu, g, u, history_g, history_u, seen, zx, zw = res
    b, s, f = dh.shape
    flat = (b * s, f)
    qg, tg, qu, tu, ag, au, sg, su = grad_fn(dh.reshape(flat), g.reshape(flat), u.reshape(flat),
                                             jnp.stack([history_g[2], history_u[2]]))
    qg, qu = qg.reshape(b, s, f), qu.reshape(b, s, f)
    tg, tu = tg.reshape(f, b, s), tu.reshape(f, b, s)
    dx = (fp8.scaled_product("bsf,ef->bse", qg, wqg, sg * swg, accum, zx.dtype, PRECISE)
          + fp8.scaled_product("bsf,ef->bse", qu, wqu, su * swu, accum, zx.dtype, PRECISE))
    dwg = fp8.scaled_product("bse,fbs->ef", xq, tg, sx * sg, accum, zw.dtype, PRECISE)
    dwu = fp8.scaled_product("bse,fbs->ef", xq, tu, sx * su, accum, zw.dtype, PRECISE)
    records = (fp8.record(history_g, jnp.stack([seen[0], seen[1], ag])),
               fp8.record(history_u, jnp.stack([seen[0], seen[2], au])))
    return dx, dwg, dwu, None, *records  # the held copies take no gradient (None: zeros)


_gate_up.defvjp(_gate_up_fwd, _gate_up_bwd)
