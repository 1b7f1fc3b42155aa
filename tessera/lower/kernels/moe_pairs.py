"""Decode's experts for a few (token, expert) pairs in four launches (Pallas, Triton backend):
`reference.moe.pairs_ffn`.

After the routing, the reference's pairs path is, on the GPU, the MXFP4 GEMV of gate and up (one launch,
tessera/lower/kernels/mxfp4_gemv.py) and of down, each followed by XLA kernels: the broadcast of each token to its
k copies, the two GEMVs' split-K sums (each a reduce of its own behind an optimization barrier), the SwiGLU with its
bias gather, and the routing weights' combine: ~5 launches of ~1.3-1.8 us a layer for a few thousand values
(docs/kernels-log.md, "Where a batch-1 decode layer goes now"). Here the GEMVs read each token's row for its k
copies themselves (`per`), and two small kernels take their fp32 split partials as they are:

    swiglu:  h[r]  = act(sum_s gate_parts[s, r] + gate_bias[e_r], sum_s up_parts[s, r] + up_bias[e_r])
    combine: y[t]  = sum_j w[t, j] * (sum_s down_parts[s, t k + j] + down_bias[e_{t k + j}])

each sum in a fixed order (splits ascending, then the token's copies in routing order): deterministic, the same
arithmetic as the reference's up to the order of the split-K sum, which the reference (unsplit) does not have.
Forward only (decode; nothing differentiates it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tessera.lower.kernels import mxfp4_gemv
from tessera.lower.kernels._vma import common, out_struct
from tessera.lower.kernels.mxfp4_matmul import supported_pairs
from tessera.lower.reference import mxfp4 as ref


@dataclasses.dataclass(frozen=True)
class PairsConfig:
    """The epilogue kernels' programs: `block` columns each over `num_warps` warps; `gemv` the GEMVs' config
    (default `mxfp4_gemv.pair_config`); `interpret` runs all of it on the CPU (tests).

    Small programs, many of them: the combine reads every split partial of a token's k copies (GPT-OSS-20B at batch
    1: 30 splits x 4 copies x 2880 columns, 1.4 MB), which a few 1024-column programs would each pull through one
    SM. Measured (one H100, GPT-OSS-20B batch-1 decode, `bench.experiments.decode_variants`, one process): 2.283 ms
    a token at 64 columns, 2.323 at 128, 2.539 at 256 over 2 warps, 2.934 at 1024 over 4; XLA's epilogues 2.281."""
    block: int = 64
    num_warps: int = 1
    gemv: mxfp4_gemv.GemvConfig | None = None
    interpret: bool = False

    def __post_init__(self):
        if self.block < 32 or self.block & (self.block - 1):
            raise ValueError(f"block={self.block} must be a power of two >= 32 (Triton tiles)")


def supported(x, weights, experts, *, gate, up, down, config: PairsConfig | None = None, **_) -> bool:
    """MXFP4 gate, up [G, D, F] and down [G, F, D]; x bf16 [T, D]; weights [T, k], experts int [T, k]; on the GPU
    (or the interpreter) where the pairs GEMV takes each product."""
    if not all(isinstance(m, ref.MXFP4) for m in (gate, up, down)):
        return False
    if x.ndim != 2 or experts.ndim != 2 or weights.shape != experts.shape or experts.shape[0] != x.shape[0]:
        return False
    r, (_, d, f) = experts.size, gate.shape
    if up.shape != gate.shape or down.shape != (gate.shape[0], f, d):
        return False
    flat = jax.ShapeDtypeStruct((r,), jnp.int32)
    gemv = None
    if config is not None:  # its GEMVs' own config, else the interpreter's where it asks for that
        gemv = config.gemv or (mxfp4_gemv.GemvConfig(interpret=True) if config.interpret else None)
    rows = lambda n: jax.ShapeDtypeStruct((r, n), x.dtype)  # noqa: E731 (what each GEMV multiplies)
    return supported_pairs(rows(d), (gate, up), flat, gemv) and supported_pairs(rows(f), down, flat, gemv)


def _columns(j, block: int, n: int):
    c = j * block + jnp.arange(block, dtype=jnp.int32)
    return c, c < n


def _split_sum(parts_ref, row, c, ok, *, splits: int, stride: int):
    """sum over s of parts[s * stride + row * n + c] (flat offsets, row's offset given), s ascending, fp32."""
    acc = None
    for s in range(splits):
        v = pltriton.load(parts_ref.at[s * stride + row + c], mask=ok, other=0.0).astype(jnp.float32)
        acc = v if acc is None else acc + v
    return acc


def _bias(ref_, e, n: int, c, ok):
    return pltriton.load(ref_.at[e * n + c], mask=ok, other=0.0).astype(jnp.float32)


def _swiglu_kernel(ex_ref, parts_ref, gb_ref, ub_ref, h_ref, *, splits: int, rows: int, n: int, block: int, act):
    r, j = pl.program_id(0), pl.program_id(1)
    c, ok = _columns(j, block, n)
    e = ex_ref[r]
    total = functools.partial(_split_sum, parts_ref, c=c, ok=ok, splits=splits, stride=2 * rows * n)
    g = total(r * n) + _bias(gb_ref, e, n, c, ok)
    u = total((rows + r) * n) + _bias(ub_ref, e, n, c, ok)
    h = act(g.astype(h_ref.dtype), u.astype(h_ref.dtype))
    pltriton.store(h_ref.at[r * n + c], h.astype(h_ref.dtype), mask=ok)


def _combine_kernel(ex_ref, w_ref, parts_ref, db_ref, y_ref, *, splits: int, rows: int, n: int, block: int,
                    top_k: int):
    t, j = pl.program_id(0), pl.program_id(1)
    c, ok = _columns(j, block, n)
    acc = None
    for q in range(top_k):  # the token's copies in routing order
        r = t * top_k + q
        y = _split_sum(parts_ref, r * n, c, ok, splits=splits, stride=rows * n) + _bias(db_ref, ex_ref[r], n, c, ok)
        term = y * w_ref[r].astype(jnp.float32)
        acc = term if acc is None else acc + term
    pltriton.store(y_ref.at[t * n + c], acc.astype(y_ref.dtype), mask=ok)


def _launch(body, grid, out_len: int, dtype, cfg: PairsConfig, *args):
    args = common(*args)
    return pl.pallas_call(
        body, out_shape=out_struct((out_len,), dtype, *args), grid=grid,
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=cfg.interpret, name=body.func.__name__.strip("_"),
    )(*args)


def pairs_ffn(x, weights, experts, *, gate, up, down, gate_bias, up_bias, down_bias, act,
              config: PairsConfig | None = None):
    """`reference.moe.pairs_ffn`: x [T, D] (bf16), routing weights [T, k] and experts [T, k] -> [T, D] in x's dtype,
    by the pairs GEMV (each token's row read for its k copies) and the two epilogue kernels above."""
    cfg = config or PairsConfig()
    t, d = x.shape
    k = experts.shape[1]
    r, f = t * k, gate.shape[-1]
    flat = experts.reshape(-1).astype(jnp.int32)
    gemv = cfg.gemv or mxfp4_gemv.pair_config(r, d, f, interpret=cfg.interpret)
    gu = mxfp4_gemv.gemv_parts(x, (gate, up), flat, gemv, jnp.float32, per=k)  # [S, 2, R, F]
    tiles = lambda n: -(-n // cfg.block)  # noqa: E731
    swiglu = functools.partial(_swiglu_kernel, splits=gu.shape[0], rows=r, n=f, block=cfg.block, act=act)
    h = _launch(swiglu, (r, tiles(f)), r * f, x.dtype, cfg, flat, gu.reshape(-1), gate_bias.reshape(-1),
                up_bias.reshape(-1)).reshape(r, f)
    dn = mxfp4_gemv.gemv_parts(h, down, flat, gemv, jnp.float32)  # [S, 1, R, D]
    combine = functools.partial(_combine_kernel, splits=dn.shape[0], rows=r, n=d, block=cfg.block, top_k=k)
    y = _launch(combine, (t, tiles(d)), t * d, x.dtype, cfg, flat, weights.reshape(-1).astype(jnp.float32),
                dn.reshape(-1), down_bias.reshape(-1))
    return y.reshape(t, d)
