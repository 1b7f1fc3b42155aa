"""The MLP (gate and up products, SwiGLU, the down product) under delayed fp8 scaling as one custom VJP, so that
SwiGLU's backward, the quantisation of its two gradients and of h for the down product's weight gradient are one
pass (the lowering table's `swiglu_grad_delayed`: a kernel on a GPU, tessera/lower/kernels/fp8_cast.py; its
reference elsewhere).

Built from the products alone (reference/fp8.py), JAX differentiates SwiGLU and hands each gradient to its
product's custom VJP, which takes its amax (the history's record, and the scale while the history is empty) and
quantises it; the weight gradient's GEMM then reads the codes token-minor (cuBLASLt's fp8 GEMMs take both operands
contiguous along K), so XLA:GPU transposes them too. At the Llama-1B shape (16,384 tokens x 8,192, one H100,
session 45's profile) that was a pass for the amaxes and one multi-output fusion of 1,165 us a layer, ~2.5x its
bytes' time. Here the backward asks for both gradients' codes in both layouts, their amaxes and scales at once.
The down product's weight gradient reads h's codes token-minor too; under remat XLA recomputed them from gate's and
up's outputs and transposed them in a fusion of its own (730 us a layer, session 49's profile of that step): here
the same pass codes h again, transposed, at the scale its forward used, and measures h's amax for the history (the
forward no longer does: under remat its recomputation in the backward was a reduce over gate and up of its own).

The numbers are the built products' (the CPU runs both bit for bit: tests/lower/test_fp8_mlp.py): the forward
quantises x once, by gate's input row (up's records the same amaxes, x's, every step, so the two rows are equal),
makes gate and up with the same fp8 products, and h's codes as the down product does; the backward's products are
the built backward's, the weight gradients' reading transposed codes. Where it does not apply (another scaling,
biases, GPT-OSS's clamped SwiGLU, a sharded or deterministic-tp MLP, a narrow accumulator) the products run one by
one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tessera.ir.registry import struct_fields
from tessera.lower import table
from tessera.lower.fp8_held import held_of
from tessera.lower.reference import accum as accum_ref, fp8
from tessera.lower.reference.fp8 import E4M3, PRECISE
from tessera.lower.reference.fp8_cast import swiglu_rounded

PRIMITIVE = "swiglu_grad_delayed"


def applies(ctx, attrs, params: dict, x) -> bool:
    """Whether the MLP's gate, up, SwiGLU and down run as `mlp` here."""
    act = attrs["act"]
    return (ctx.fp8 is not None and fp8.delayed_of(ctx.fp8) is not None and bool(ctx.fp8_history)
            and all(n in ctx.fp8_history for n in ("gate", "up", "down")) and ctx.shard is None
            and ctx.tensor is None and "gate_bias" not in params and "down_bias" not in params
            and act.kind == "swiglu" and struct_fields(act).get("alpha") is None
            and not accum_ref.narrow(ctx.accum_dtype) and x.ndim == 3)


def mlp(ctx, label: str, x, gate, up, down, cols, rows, cast):
    """down ⊗ swiglu(x ⊗ gate, x ⊗ up) [b, s, e] in `rows` (the down product's stored dtype; gate's and up's
    outputs in `cols`), the weights cast to x's dtype; `cast`: the kernel quantising the output gradient (ops_nn's
    `_gradient_cast`), None for the products' own quantisation."""
    f = gate.shape[-1]
    grad = jax.ShapeDtypeStruct((x.shape[0] * x.shape[1], f), x.dtype)
    history_rows = jax.ShapeDtypeStruct((2, ctx.fp8_history["gate"].shape[-1]), jnp.float32)
    choice, fn = table.choose(ctx, PRIMITIVE, grad, grad, grad, history_rows, jax.ShapeDtypeStruct((), jnp.float32))
    if ctx.report is not None:
        ctx.report[f"{label}: SwiGLU's gradient to e5m2"] = choice
    histories = tuple(ctx.fp8_history[n] for n in ("gate", "up", "down"))
    held = []
    for name, w, history, spec in (("gate", gate, histories[0], "bse,ef->bsf"), ("up", up, histories[1], "bse,ef->bsf"),
                                   ("down", down, histories[2], "bsf,fe->bse")):
        h = held_of(ctx, name, x.dtype)
        h = fp8.hold(w, x.dtype, history) if h is None else h
        fspec, wt = fp8.forward_operand(spec, h)
        held.append((h[0], h[1], h[2], wt, fspec))
    arrays = tuple(jax.lax.stop_gradient(a) for h in held for a in h[:4])
    dtypes = (jnp.dtype(ctx.accum_dtype), jnp.dtype(cols), jnp.dtype(rows))
    return _mlp(x, gate, up, down, arrays, histories, dtypes, fn, cast, tuple(h[4] for h in held))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _mlp(x, wg, wu, wd, held, histories, dtypes, grad_fn, cast, fspecs):
    return _mlp_fwd(x, wg, wu, wd, held, histories, dtypes, grad_fn, cast, fspecs)[0]


def _mlp_fwd(x, wg, wu, wd, held, histories, dtypes, grad_fn, cast, fspecs):
    accum, cols, rows = dtypes
    wqg, swg, awg, wtg, wqu, swu, awu, wtu, wqd, swd, awd, wtd = held
    history_g, history_u, history_d = histories
    ax = fp8.amax_of(x)
    xq, sx = fp8.quantize_delayed(x, history_g[0], E4M3)
    g = fp8.scaled_product(fspecs[0] or "bse,ef->bsf", xq, wtg, sx * swg, accum, cols).astype(x.dtype)
    u = fp8.scaled_product(fspecs[1] or "bse,ef->bsf", xq, wtu, sx * swu, accum, cols).astype(x.dtype)
    h = swiglu_rounded(g, u)  # fp32 holding x's dtype's values; its amax comes from the backward's pass (grad_fn)
    hq, sh = fp8.quantize_delayed(h, history_d[0], E4M3)  # the backward codes h again (grad_fn), transposed
    y = fp8.scaled_product(fspecs[2] or "bsf,fe->bse", hq, wtd, sh * swd, accum, rows)
    zx, zw = jnp.zeros((0,), x.dtype), jnp.zeros((0,), wg.dtype)  # the operands' dtypes, not their values
    seen = jnp.stack([ax, awg, awu, awd])
    return y, (xq, sx, wqg, swg, wqu, swu, wqd, swd, sh, g, u, histories, seen, zx, zw)


def _mlp_bwd(dtypes, grad_fn, cast, fspecs, res, dy):
    accum = dtypes[0]
    xq, sx, wqg, swg, wqu, swu, wqd, swd, sh, g, u, histories, seen, zx, zw = res
    history_g, history_u, history_d = histories
    qd, dspec, td, ad, sd = fp8.cast_gradient(cast, "bse", "bsf", "fe", dy, history_d[2])
    dh = fp8.scaled_product("bse,fe->bsf", qd, wqd, sd * swd, accum, zx.dtype, PRECISE)
    b, s, f = dh.shape
    flat = (b * s, f)
    qg, tg, qu, tu, ag, au, sg, su, ht, ah = grad_fn(dh.reshape(flat), g.reshape(flat), u.reshape(flat),
                                                 jnp.stack([history_g[2], history_u[2]]), sh)
    dwd = fp8.scaled_product(f"fbs,{dspec}->fe", ht.reshape(f, b, s), td, sh * sd, accum, zw.dtype, PRECISE)
    qg, qu = qg.reshape(b, s, f), qu.reshape(b, s, f)
    tg, tu = tg.reshape(f, b, s), tu.reshape(f, b, s)
    dx = (fp8.scaled_product("bsf,ef->bse", qg, wqg, sg * swg, accum, zx.dtype, PRECISE)
          + fp8.scaled_product("bsf,ef->bse", qu, wqu, su * swu, accum, zx.dtype, PRECISE))
    dwg = fp8.scaled_product("bse,fbs->ef", xq, tg, sx * sg, accum, zw.dtype, PRECISE)
    dwu = fp8.scaled_product("bse,fbs->ef", xq, tu, sx * su, accum, zw.dtype, PRECISE)
    records = (fp8.record(history_g, jnp.stack([seen[0], seen[1], ag])),
               fp8.record(history_u, jnp.stack([seen[0], seen[2], au])),
               fp8.record(history_d, jnp.stack([ah, seen[3], ad])))
    return dx, dwg, dwu, dwd, None, records  # the held copies take no gradient (None: zeros)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)
