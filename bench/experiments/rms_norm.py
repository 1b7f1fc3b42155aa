"""Fused RMSNorm with an optional residual add (Pallas, Triton backend), forward and backward.

Semantics (reference/norms.py, GPT-OSS order): h = x + r rounded to x's dtype (the residual stream),
y = h * rsqrt(mean(h^2) + eps) * scale with fp32 statistics, y in x's dtype. One program normalises
`block_r` rows [block_r, D] held whole in registers (D padded to a power of two, masked): the forward
reads x, r and scale once and writes y, h and the per-row fp32 rstd; the backward reads h, dy, the
cotangent of h and rstd and writes dh (= dx = dr); d scale = sum over rows of dy * h * rstd is one
XLA reduction outside.

Not selected by any lowering, so it lives here, out of the package (`NOT_SELECTED`; docs/kernels-log.md,
"RMSNorm", has the measurements: the forward beats XLA's fusion, forward + backward only at fewer rows).
`python -m bench.kernels --only rmsnorm` times it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tessera.lower.reference.norms import rms_norm as _rms_norm_ref

# Measured on an H200 (docs/kernels-log.md): the forward (+residual) beats XLA's fusion by 1.2-1.4x, but a
# win for training (fwd+bwd) is not shown, so the lowering keeps XLA's fusion. An empty string here
# would let `supported()` select the kernel.
NOT_SELECTED = "not selected: fwd+bwd not shown to beat XLA's fusion (docs/kernels-log.md, RMSNorm)"


@dataclasses.dataclass(frozen=True)
class RmsNormConfig:
    """block_r rows per program (each whole), num_warps warps (2 x 4: fastest of 4 variants at D=2880)."""
    block_r: int = 2
    num_warps: int = 4
    interpret: bool = False

    def __post_init__(self):
        if self.block_r < 1 or self.block_r & (self.block_r - 1):
            raise ValueError(f"{self.block_r=} must be a power of two")


def _on_gpu() -> bool:
    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


def supported(x, scale, residual=None, config: RmsNormConfig | None = None) -> tuple[bool, str]:
    """(usable, why not): a GPU (or the interpreter), fp16/bf16/fp32 x [..., D] with D <= 16384."""
    if not ((config is not None and config.interpret) or _on_gpu()):
        return False, "no GPU backend"
    if x.ndim < 1 or scale.shape != x.shape[-1:] or x.shape[-1] > 16384:
        return False, f"shape {x.shape} / scale {scale.shape} outside the kernel (D <= 16384)"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return False, "residual differs from x in shape or dtype"
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return False, f"dtype {x.dtype}"
    if NOT_SELECTED:
        return False, NOT_SELECTED
    return True, ""


def _tile(ref_rows: int, d: int, cfg: RmsNormConfig):
    """Row / column indices of this program's [block_r, Dp] tile and its mask."""
    rows = pl.program_id(0) * cfg.block_r + jnp.arange(cfg.block_r, dtype=jnp.int32)
    cols = jnp.arange(pl.next_power_of_2(d), dtype=jnp.int32)
    return rows, cols, (rows < ref_rows)[:, None] & (cols < d)[None, :]


def _fwd_kernel(*refs, cfg: RmsNormConfig, eps: float, residual: bool):
    """y = norm(x (+ r)) * scale; h = x (+ r) stored when there is a residual; rstd per row."""
    if residual:
        x_ref, r_ref, s_ref, y_ref, h_ref, rstd_ref = refs
    else:
        x_ref, s_ref, y_ref, rstd_ref = refs
    n, d = x_ref.shape
    rows, cols, mask = _tile(n, d, cfg)
    at = (rows[:, None], cols[None, :])
    h = pltriton.load(x_ref.at[at], mask=mask, other=0.0)
    if residual:
        h = (h.astype(jnp.float32) + pltriton.load(r_ref.at[at], mask=mask, other=0.0).astype(jnp.float32))
        h = h.astype(x_ref.dtype)  # the residual stream is rounded to its dtype, as unfused
        pltriton.store(h_ref.at[at], h, mask=mask)
    hf = h.astype(jnp.float32)  # [block_r, Dp], padding 0
    rstd = jax.lax.rsqrt(jnp.sum(hf * hf, axis=1) / d + eps)  # [block_r]
    s = pltriton.load(s_ref.at[cols], mask=cols < d, other=0.0).astype(jnp.float32)
    y = hf * rstd[:, None] * s[None, :]
    pltriton.store(y_ref.at[at], y.astype(y_ref.dtype), mask=mask)
    pltriton.store(rstd_ref.at[rows], rstd, mask=rows < n)


def _bwd_kernel(*refs, cfg: RmsNormConfig, residual: bool, rows_per_program: int):
    """dh = rstd * (g - yhat * mean(g * yhat)) (+ the cotangent of h), g = dy * scale, yhat = h * rstd.

    A program walks `rows_per_program` rows in blocks of block_r and also writes its partial
    d scale = sum over its rows of dy * yhat (fp32 [programs, D], summed outside).
    """
    if residual:
        h_ref, dy_ref, dh_out_ref, s_ref, rstd_ref, dh_ref, ds_ref = refs
    else:
        h_ref, dy_ref, s_ref, rstd_ref, dh_ref, ds_ref = refs
    n, d = h_ref.shape
    cols = jnp.arange(pl.next_power_of_2(d), dtype=jnp.int32)
    s = pltriton.load(s_ref.at[cols], mask=cols < d, other=0.0).astype(jnp.float32)
    pid = pl.program_id(0)  # read outside the loop (the interpreter substitutes it at the top level only)

    def block(i, ds):
        rows = pid * rows_per_program + i * cfg.block_r + jnp.arange(cfg.block_r, dtype=jnp.int32)
        mask = (rows < n)[:, None] & (cols < d)[None, :]
        at = (rows[:, None], cols[None, :])
        hf = pltriton.load(h_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
        dy = pltriton.load(dy_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
        rstd = pltriton.load(rstd_ref.at[rows], mask=rows < n, other=0.0)[:, None]
        g, yhat = dy * s[None, :], hf * rstd
        dh = rstd * (g - yhat * (jnp.sum(g * yhat, axis=1, keepdims=True) / d))
        if residual:
            dh += pltriton.load(dh_out_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
        pltriton.store(dh_ref.at[at], dh.astype(dh_ref.dtype), mask=mask)
        return ds + jnp.sum(dy * yhat, axis=0)

    ds = jax.lax.fori_loop(0, rows_per_program // cfg.block_r, block, jnp.zeros(cols.shape, jnp.float32))
    pltriton.store(ds_ref.at[jnp.full((1, 1), pid, jnp.int32), cols[None, :]], ds[None, :], mask=(cols < d)[None, :])


def _call(body, cfg: RmsNormConfig, programs: int, out_shape, *args):
    return pl.pallas_call(
        body, out_shape=out_shape, grid=(programs,),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=cfg.interpret, name="rms_norm",
    )(*args)


def _rows_per_program(n: int, block_r: int) -> int:
    """Rows per backward program: ~512 programs (4 per SM of an H100/H200), a multiple of block_r."""
    per = max(block_r, pl.next_power_of_2(-(-n // 512)))
    return -(-per // block_r) * block_r


def _forward(x2, r2, scale, eps: float, cfg: RmsNormConfig):
    """x2, r2 [N, D] -> (y, h, rstd [N] fp32); h is x2 without a residual."""
    n, d = x2.shape
    res = r2 is not None
    out = [jax.ShapeDtypeStruct((n, d), x2.dtype)] * (2 if res else 1) + [jax.ShapeDtypeStruct((n,), jnp.float32)]
    body = functools.partial(_fwd_kernel, cfg=cfg, eps=eps, residual=res)
    outs = _call(body, cfg, pl.cdiv(n, cfg.block_r), out, *((x2, r2, scale) if res else (x2, scale)))
    return (outs[0], outs[1], outs[2]) if res else (outs[0], x2, outs[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(x2, r2, scale, eps, cfg, has_res):
    y, h, _ = _forward(x2, r2, scale, eps, cfg)
    return y, h


def _fused_fwd(x2, r2, scale, eps, cfg, has_res):
    y, h, rstd = _forward(x2, r2, scale, eps, cfg)
    return (y, h), (h, scale, rstd)


def _fused_bwd(eps, cfg, has_res, res, cts):
    h, scale, rstd = res
    dy, dh_out = cts
    n, d = h.shape
    per = _rows_per_program(n, cfg.block_r)
    programs = pl.cdiv(n, per)
    body = functools.partial(_bwd_kernel, cfg=cfg, residual=has_res, rows_per_program=per)
    args = (h, dy.astype(h.dtype)) + ((dh_out.astype(h.dtype),) if has_res else ()) + (scale, rstd)
    out = (jax.ShapeDtypeStruct((n, d), h.dtype), jax.ShapeDtypeStruct((programs, d), jnp.float32))
    dh, dscale = _call(body, cfg, programs, out, *args)
    if not has_res:  # h is x itself: its cotangent (zero unless h is used) joins dx outside the kernel
        dh = (dh.astype(jnp.float32) + dh_out.astype(jnp.float32)).astype(h.dtype)
    return dh, (dh if has_res else None), dscale.sum(axis=0).astype(scale.dtype)


_fused.defvjp(_fused_fwd, _fused_bwd)


def add_rms_norm(x, residual, scale, *, eps: float, config: RmsNormConfig | None = None):
    """(rms_norm(x + residual) * scale, x + residual) for x, residual [..., D], scale [D]."""
    d = x.shape[-1]
    y, h = _fused(x.reshape(-1, d), residual.reshape(-1, d), scale, float(eps),
                  config or RmsNormConfig(), True)
    return y.reshape(x.shape), h.reshape(x.shape)


def rms_norm(x, scale, *, eps: float, config: RmsNormConfig | None = None):
    """rms_norm(x [..., D]) * scale [D], fp32 statistics, x's dtype out."""
    d = x.shape[-1]
    y, _ = _fused(x.reshape(-1, d), None, scale, float(eps), config or RmsNormConfig(), False)
    return y.reshape(x.shape)


def add_rms_norm_reference(x, residual, scale, *, eps: float):
    """The semantics in jax.numpy: h = x + residual in x's dtype, then reference/norms.rms_norm."""
    h = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    return _rms_norm_ref(h, scale=scale, eps=eps), h
