"""MoE gate/up grouped GEMM with GPT-OSS's clamped SwiGLU fused into the epilogue (Mosaic GPU).

    g = x @ gate[e] + gate_bias[e];  u = x @ up[e] + up_bias[e]     x [M, D] sorted by expert
    h = (clip(u, -limit, limit) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit))   [M, F]

One kernel computes the gate and up tiles of the same rows (two accumulators over one stream of
x tiles) and writes h only: half the output bytes of the unfused pair, and no [M, 2F] round trip
through HBM before the activation. It is `grouped_matmul`'s kernel with two right-hand sides and
this epilogue. Rows past sum(group_sizes) give 0.

Gradients (custom_vjp): under differentiation the forward runs the two grouped GEMMs unfused and
keeps g, u (no recomputation), the products stored in x's dtype before the bias as the MoE
lowering stores them (the reference with `product_dtype`); d g, d u are elementwise, then
d x = d g @ gate^T + d u @ up^T and d gate, d up are per-expert x^T @ d g, x^T @ d u, all on the
grouped kernels.

Measured (H200, 32768 rows, 128 experts, D = F = 2880): 2.89 ms, the unfused pair of 192-wide
grouped GEMMs + XLA activation 2.95 ms. F = 2880 allows only 64-wide accumulator pairs here (2 x 64
per stream of x tiles, the plain kernel's 128-wide tile: 2.88 ms for 2880 -> 5760), which eats the
saved bytes; so the MoE lowering does not pick this kernel (yet). bench/moe_variants.py times it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tessera.lower.kernels import _mgpu
from tessera.lower.kernels import grouped_matmul as gm
from tessera.lower.reference.activations import clamped_swiglu


def _activation(g, u, alpha: float, limit: float):
    """The clamped SwiGLU on fp32 tiles (jnp ops the kernel epilogue lowers)."""
    g = jnp.minimum(g, limit)
    u = jnp.minimum(jnp.maximum(u, -limit), limit)
    return (u + 1.0) * g / (1.0 + jnp.exp(-alpha * g))


def _epilogue(alpha: float, limit: float, has_bias: bool):
    """Epilogue for grouped_call: + biases (read from HBM as column vectors), then the activation."""
    def epilogue(accs, *, grp, ni, extra, num_groups, bn, interpret):
        g, u = accs
        if has_bias:
            live = (grp < num_groups).astype(jnp.float32)  # rows past sum(group_sizes): no bias, h = 0
            row = jnp.minimum(grp, num_groups - 1)
            b = [_column(ref.at[row], pl.ds(ni * bn, bn), interpret) * live for ref in extra]
            g = g + lax.broadcast_in_dim(b[0], g.shape, (1,))
            u = u + lax.broadcast_in_dim(b[1], u.shape, (1,))
        return _activation(g, u, alpha, limit)
    return epilogue


def _column(ref, idx, interpret: bool):
    """A [bn] fp32 vector from HBM in the layout of an accumulator's columns (the interpreter: plain)."""
    if interpret:
        return ref[idx]
    return _mgpu.load(ref.at[idx], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)


def default_config(f: int) -> gm.GroupedMatmulConfig:
    """Two accumulators per consumer: N tile 64 (or 128 where f allows); 6 stages (H200: 2.89 ms, 4: 2.99)."""
    return gm.GroupedMatmulConfig(block_n=128 if f % 128 == 0 else 64, stages=6 if f % 128 else 3)


def supported(x, gate, up, group_sizes) -> bool:
    """grouped_matmul's conditions for both weights, which must match."""
    return gate.shape == up.shape and gm.supported(x, gate, group_sizes) and gm.supported(x, up, group_sizes)


def fused_call(x, gate, up, gate_bias, up_bias, group_sizes, *, alpha, limit, cfg):
    """h [M, F] from one kernel (biases [G, F] or None)."""
    has_bias = gate_bias is not None
    extra = (gate_bias.astype(jnp.float32), up_bias.astype(jnp.float32)) if has_bias else ()
    return gm.grouped_call(x, [gate, up], group_sizes, cfg, epilogue=_epilogue(alpha, limit, has_bias),
                           extra=extra)


def _bias_rows(bias, group_sizes, m):
    """bias[group(r)] per row [M, F] fp32 (0 past sum(group_sizes))."""
    ids = jnp.repeat(jnp.arange(bias.shape[0]), group_sizes, total_repeat_length=m)
    valid = jnp.arange(m) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], bias.astype(jnp.float32)[ids], 0.0)


def _plain(n: int, cfg) -> gm.GroupedMatmulConfig:
    """grouped_matmul's default tiles for width n (one accumulator), in cfg's mode."""
    return dataclasses.replace(gm.default_config(n), interpret=cfg.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _fused(x, gate, up, gate_bias, up_bias, group_sizes, alpha, limit, cfg):
    return fused_call(x, gate, up, gate_bias, up_bias, group_sizes, alpha=alpha, limit=limit, cfg=cfg)


def _fused_fwd(x, gate, up, gate_bias, up_bias, group_sizes, alpha, limit, cfg):
    pcfg = _plain(gate.shape[2], cfg)
    g = gm.grouped_call(x, [gate], group_sizes, pcfg).astype(jnp.float32)  # bf16, as the MoE reference
    u = gm.grouped_call(x, [up], group_sizes, pcfg).astype(jnp.float32)
    if gate_bias is not None:
        g = g + _bias_rows(gate_bias, group_sizes, x.shape[0])
        u = u + _bias_rows(up_bias, group_sizes, x.shape[0])
    valid = (jnp.arange(x.shape[0]) < jnp.sum(group_sizes))[:, None]
    h = jnp.where(valid, _activation(g, u, alpha, limit), 0.0).astype(x.dtype)
    return h, (x, gate, up, gate_bias, up_bias, group_sizes, g, u)


def _fused_bwd(alpha, limit, cfg, res, dh):
    x, gate, up, gate_bias, up_bias, group_sizes, g, u = res
    _, vjp = jax.vjp(lambda g, u: _activation(g, u, alpha, limit), g, u)
    dg, du = vjp(dh.astype(jnp.float32))
    valid = (jnp.arange(x.shape[0]) < jnp.sum(group_sizes))[:, None]
    dg, du = (jnp.where(valid, d, 0.0).astype(x.dtype) for d in (dg, du))
    tcfg = _plain(x.shape[1], cfg)
    dx = (gm.grouped_call(dg, [gate], group_sizes, tcfg, transpose_rhs=True).astype(jnp.float32)
          + gm.grouped_call(du, [up], group_sizes, tcfg, transpose_rhs=True))
    wcfg = _plain(gate.shape[2], cfg)
    dgate = gm.grouped_drhs(x, dg, group_sizes, gate.shape[0], wcfg).astype(gate.dtype)
    dup = gm.grouped_drhs(x, du, group_sizes, up.shape[0], wcfg).astype(up.dtype)
    dbias = [None, None]
    if gate_bias is not None:
        ids = jnp.repeat(jnp.arange(gate.shape[0]), group_sizes, total_repeat_length=x.shape[0])
        dbias = [jax.ops.segment_sum(d.astype(jnp.float32), ids, num_segments=gate.shape[0]).astype(b.dtype)
                 for d, b in ((dg, gate_bias), (du, up_bias))]
    return dx.astype(x.dtype), dgate, dup, dbias[0], dbias[1], None


_fused.defvjp(_fused_fwd, _fused_bwd)


def grouped_swiglu(x, gate, up, group_sizes, *, gate_bias=None, up_bias=None, alpha: float = 1.702,
                   limit: float = 7.0, config: gm.GroupedMatmulConfig | None = None):
    """clamped_swiglu(ragged_dot(x, gate) + gate_bias, ragged_dot(x, up) + up_bias) [M, F], fused."""
    cfg = config or default_config(gate.shape[2])
    return _fused(x, gate, up, gate_bias, up_bias, group_sizes.astype(jnp.int32), alpha, limit, cfg)


def grouped_swiglu_reference(x, gate, up, group_sizes, *, gate_bias=None, up_bias=None, alpha: float = 1.702,
                             limit: float = 7.0, product_dtype=None):
    """The semantics in jax.numpy: fp32 products (+ bias), activation, output in x's dtype.

    `product_dtype`: the products rounded to it before the bias is added (in fp32), as the MoE
    lowering stores them (`named.stored_dtype`) and as `grouped_swiglu`'s differentiated path does.
    """
    f32 = dict(preferred_element_type=jnp.float32)
    g = jax.lax.ragged_dot(x, gate, group_sizes, **f32)
    u = jax.lax.ragged_dot(x, up, group_sizes, **f32)
    if product_dtype is not None:
        g, u = (p.astype(product_dtype).astype(jnp.float32) for p in (g, u))
    if gate_bias is not None:
        g = g + _bias_rows(gate_bias, group_sizes, x.shape[0])
        u = u + _bias_rows(up_bias, group_sizes, x.shape[0])
    h = clamped_swiglu(g, u, alpha=alpha, limit=limit)
    valid = (jnp.arange(x.shape[0]) < jnp.sum(group_sizes))[:, None]
    return jnp.where(valid, h, 0.0).astype(x.dtype)


def config_for(f: int, **kw) -> gm.GroupedMatmulConfig:
    """default_config(f) with fields replaced (bench variants)."""
    return dataclasses.replace(default_config(f), **kw)
