"""The MLP's gate and up products and SwiGLU as one custom VJP whose backward quantises SwiGLU's gradient with the
Pallas kernel of fp8_cast_transpose (both e5m2 layouts and the amaxes in one pass), patched into the `mlp` lowering
for `bench.experiments.train_variants` ("fused swiglu gradient").

The built form differentiates SwiGLU with JAX and hands each gradient to its product's custom VJP, which quantises
it; XLA fuses SwiGLU's backward, both quantisations and the transposes the weight gradients' GEMMs take into one
fusion at ~2.5x its bytes' time (1,165 us a layer at the Llama-1B shape, session 45), after a separate pass for the
gradients' amaxes (their delayed scaling's fallback and history). Here the one custom VJP keeps the products'
outputs gate and up as its residuals (remat `dots` keeps them as the outputs of dot_generals inside the custom
VJP's forward, as a policy sees the names flash attention gives its residuals there), and its backward:

    d gate, d up codes (row and token-minor layouts), amaxes = kernel(dh, gate, up, scales from the histories)
    dx  = (d gate_q ⊗ w_gate_qᵀ) / (s · s_w) + (d up_q ⊗ w_up_qᵀ) / (s · s_w)
    dw  = (x_qᵀ ⊗ d gate_qᵀ) / (s_x · s)  (both operands token-minor, the layout cuBLASLt's fp8 GEMM takes)

Delayed scaling only, every gradient scaled from its history alone (train_variants' "history only", which is this
variant's baseline: step 1's gradients underflow, so the timing, not the loss, is what it measures); x is quantised
once, by gate's input row (up's holds the same amaxes). Where it does not apply (another scaling, biases, GPT-OSS's
clamped SwiGLU, a mesh, deterministic tp's chunks) the built lowering runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bench.experiments.fp8_cast_transpose import swiglu_grad_e5m2
from tessera.lower import ops_nn, table
from tessera.lower.fp8_held import held_of
from tessera.lower.named import align, names, stored_dtype
from tessera.lower.ops_nn import BSE
from tessera.lower.reference import activations, fp8
from tessera.lower.reference.fp8 import E4M3

BUILT = table.LOWERINGS["mlp"]


def _scale(row):
    """The power of two from a history row's max alone (1 while the row is empty), as "history only" scales."""
    past = jnp.max(row)
    return fp8._pow2_scale(jnp.where((past > 0) & jnp.isfinite(past), past, 0.0), fp8.E5M2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _gate_up(x, wg, wu, held_g, held_u, hist_g, hist_u, aw, accum, out_dtype):
    return _gate_up_fwd(x, wg, wu, held_g, held_u, hist_g, hist_u, aw, accum, out_dtype)[0]


def _product_of(x2, held, accum, out_dtype, sx):
    fspec, w = fp8.forward_operand("te,ef->tf", held)
    return fp8._product(fspec or "te,ef->tf", x2, w, sx * held[1], accum, out_dtype)


def _gate_up_fwd(x, wg, wu, held_g, held_u, hist_g, hist_u, aw, accum, out_dtype):
    t = x.shape[0] * x.shape[1]
    x2 = x.reshape(t, x.shape[2])
    xq, sx = fp8.quantize_delayed(x2, hist_g[0], E4M3)
    g = _product_of(xq, held_g, accum, out_dtype, sx).astype(x.dtype)
    u = _product_of(xq, held_u, accum, out_dtype, sx).astype(x.dtype)
    h = activations.swiglu(g, u).reshape(x.shape[:2] + (g.shape[-1],))
    seen = jnp.stack([fp8._amax(x2), aw[0], aw[1]])
    zx, zw = jnp.zeros((0,), x.dtype), jnp.zeros((0,), wg.dtype)
    return h, (xq, sx, held_g[0], held_g[1], held_u[0], held_u[1], g, u, hist_g, hist_u, seen, zx, zw)


def _gate_up_bwd(accum, out_dtype, res, dh):
    xq, sx, wgq, swg, wuq, swu, g, u, hist_g, hist_u, seen, zx, zw = res
    b, s, f = dh.shape
    scales = jnp.stack([_scale(hist_g[2]), _scale(hist_u[2])])
    interpret = jax.default_backend() != "gpu"
    gq, gt, uq, ut, ag, au = swiglu_grad_e5m2(dh.reshape(b * s, f), g, u, scales, interpret=interpret)
    dx = (fp8._product("tf,ef->te", gq, wgq, scales[0] * swg, accum, zx.dtype, fp8.PRECISE)
          + fp8._product("tf,ef->te", uq, wuq, scales[1] * swu, accum, zx.dtype, fp8.PRECISE))
    xt = xq.T  # [e, t]: token-minor, as the weight gradients' GEMMs take both operands
    dwg = fp8._product("et,ft->ef", xt, gt, sx * scales[0], accum, zw.dtype, fp8.PRECISE)
    dwu = fp8._product("et,ft->ef", xt, ut, sx * scales[1], accum, zw.dtype, fp8.PRECISE)
    record_g = fp8._record(hist_g, jnp.stack([seen[0], seen[1], ag]))
    record_u = fp8._record(hist_u, jnp.stack([seen[0], seen[2], au]))
    # the held copies and their amaxes take no gradient (None: zeros)
    return dx.reshape(b, s, -1), dwg, dwu, None, None, record_g, record_u, jnp.zeros((2,), jnp.float32)


_gate_up.defvjp(_gate_up_fwd, _gate_up_bwd)


def _applies(ctx, op, attrs, params) -> bool:
    act = attrs["act"]
    return (ctx.fp8 is not None and ctx.fp8.startswith("delayed(") and ctx.fp8_history is not None
            and ctx.shard is None and ctx.tensor is None and "gate_bias" not in params
            and act.kind == "swiglu" and ops_nn.struct_fields(act).get("alpha") is None
            and held_of(ctx, "gate", ops_nn._dtype(op)) is not None)


def fused_mlp(ctx, op, attrs, ins, params):
    """The `mlp` lowering with gate, up and SwiGLU as `_gate_up` where it applies, else the built one."""
    if not _applies(ctx, op, attrs, params):
        return BUILT.fn(ctx, op, attrs, ins, params)
    have = names(op.values[0])
    x = align(ins[0], have, BSE)
    p = ops_nn._cast(params, x.dtype)
    held_g, held_u = held_of(ctx, "gate", x.dtype), held_of(ctx, "up", x.dtype)
    # the held copies' amaxes (the history's weight row entries), as the built products record them
    aw = jnp.stack([held_g[2], held_u[2]])
    cols = stored_dtype(x.dtype, ctx.accum_dtype)
    h = _gate_up(x, p["gate"], p["up"], tuple(jax.lax.stop_gradient(a) for a in held_g),
                 tuple(jax.lax.stop_gradient(a) for a in held_u), ops_nn._history(ctx, "gate"),
                 ops_nn._history(ctx, "up"), jax.lax.stop_gradient(aw), jnp.dtype(ctx.accum_dtype), jnp.dtype(cols))
    rows = stored_dtype(ops_nn._dtype(op), ctx.accum_dtype)
    y = ops_nn._weight_product(ctx, "bsf,fe->bse", h, p["down"], rows, "down")
    return [align(y.astype(ops_nn._dtype(op)), BSE, have)]


PATCHES = [(table.LOWERINGS, "mlp", table.Lowering("mlp", fused_mlp, BUILT.stateful, BUILT.init_state))]
