"""A decode step's q, k, v after their products in one kernel (Pallas, Triton backend): `reference.kv_cache.decode_qkv`.

Between the attention projections and the decode attention kernel, the reference is, on the GPU, XLA's small
kernels a layer: the biases' adds and the rotary embedding of q and k (its concatenation of the two rotated
halves), and the writes of k and v into the KV cache (`dynamic_update_slice`s): ~3 launches of ~1.3-1.8 us each
for a few thousand values (docs/kernels-log.md, "Where a batch-1 decode layer goes now"). Here one program a (row,
head) does its head's part: q heads are biased, rotated and written out; k/v heads are biased (k rotated) and
written into the caches in place (input_output_aliases), the first of them also writing the row's position. The
arithmetic is the reference's (fp32 bias add of the stored product, cast, fp32 rotation of the cast values, cast);
Triton may contract the rotation's multiply-adds where XLA does not, so a value may differ in its last bf16 bit.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tessera.lower.kernels.mxfp4_matmul import _on_gpu


@dataclasses.dataclass(frozen=True)
class QkvConfig:
    """One program a (row, head) of `num_warps` warps; `interpret` runs it on the CPU (tests)."""
    num_warps: int = 1
    interpret: bool = False


def supported(q, k, v, cache, pos, start, *, cos, dtype, config: QkvConfig | None = None, **_) -> bool:
    """GPU (or the interpreter); one token a row: q [B, 1, H, D], k, v [B, 1, Hkv, D] with D / 2 a power of two,
    caches [B, C, Hkv, D] of `dtype`, positions int32 [B, C], a traced `start`, cos fp32 [B, 1, D / 2]."""
    if not ((config is not None and config.interpret) or _on_gpu()):
        return False
    if q.ndim != 4 or q.shape[1] != 1 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        return False
    b, _, _, d = q.shape
    half = d // 2
    if d % 2 or half & (half - 1) or cos.shape != (b, 1, half) or cos.dtype != jnp.float32:
        return False
    ck, cv, cp = cache["k"], cache["v"], cache["pos"]
    if ck.shape != cv.shape or ck.ndim != 4 or ck.shape[0] != b or ck.shape[2:] != k.shape[2:]:
        return False
    if ck.dtype != jnp.dtype(dtype) or cv.dtype != ck.dtype or cp.shape != ck.shape[:2] or cp.dtype != jnp.int32:
        return False
    return start is not None and not isinstance(start, int) and ck.size < 2**31


def _kernel(slot_ref, posv_ref, q_ref, k_ref, v_ref, cos_ref, sin_ref, *refs, h: int, hkv: int, d: int, c: int,
            biased: bool):
    if biased:
        qb_ref, kb_ref, vb_ref, *refs = refs
    _, _, _, q_out, ck_ref, cv_ref, cp_ref = refs  # the caches' inputs (aliased) are their outputs
    b, j = pl.program_id(0), pl.program_id(1)
    half = d // 2
    i = jnp.arange(half, dtype=jnp.int32)
    cs, sn = pltriton.load(cos_ref.at[b * half + i]), pltriton.load(sin_ref.at[b * half + i])

    def halves(x_ref, base, bias_ref, head):
        """The head's two halves, biased in fp32 and cast as the reference's products are."""
        lo, hi = pltriton.load(x_ref.at[base + i]), pltriton.load(x_ref.at[base + half + i])
        if biased:
            lo = lo.astype(jnp.float32) + pltriton.load(bias_ref.at[head * d + i]).astype(jnp.float32)
            hi = hi.astype(jnp.float32) + pltriton.load(bias_ref.at[head * d + half + i]).astype(jnp.float32)
        return lo.astype(q_out.dtype), hi.astype(q_out.dtype)

    def rotated(lo, hi):
        x1, x2 = lo.astype(jnp.float32), hi.astype(jnp.float32)
        return (x1 * cs - x2 * sn).astype(q_out.dtype), (x2 * cs + x1 * sn).astype(q_out.dtype)

    def put(ref, base, pair):
        pltriton.store(ref.at[base + i], pair[0])
        pltriton.store(ref.at[base + half + i], pair[1])

    @pl.when(j < h)
    def _():
        base = (b * h + j) * d
        put(q_out, base, rotated(*halves(q_ref, base, qb_ref if biased else None, j)))

    @pl.when(j >= h)
    def _():
        kv = j - h
        src, slot = (b * hkv + kv) * d, ((b * c + slot_ref[0]) * hkv + kv) * d
        put(ck_ref, slot, rotated(*halves(k_ref, src, kb_ref if biased else None, kv)))
        put(cv_ref, slot, halves(v_ref, src, vb_ref if biased else None, kv))

        @pl.when(kv == 0)
        def _():
            pltriton.store(cp_ref.at[b * c + slot_ref[0] + jnp.arange(1, dtype=jnp.int32)],
                           jnp.full((1,), posv_ref[b], jnp.int32))


def decode_qkv(q, k, v, cache, pos, start, *, q_bias, k_bias, v_bias, cos, sin, dtype,
               config: QkvConfig | None = None):
    """`reference.kv_cache.decode_qkv` in one launch: (q rotated [B, 1, H, D] in `dtype`, the cache written)."""
    cfg = config or QkvConfig()
    b, _, h, d = q.shape
    hkv, c = k.shape[2], cache["k"].shape[1]
    biases = (q_bias, k_bias, v_bias)
    biased = all(x is not None for x in biases)
    if not biased and any(x is not None for x in biases):  # some biased, some not: zeros for the rest
        biases = tuple(jnp.zeros(y.shape[2:], jnp.float32) if x is None else x for x, y in zip(biases, (q, k, v)))
        biased = True
    slot = (jnp.asarray(start, jnp.int32) % c).reshape(1)
    flat = lambda a: a.reshape(-1)  # noqa: E731
    ins = [slot, flat(pos), flat(q), flat(k), flat(v), flat(cos), flat(sin)]
    ins += [flat(x) for x in biases] if biased else []
    ins += [flat(cache["k"]), flat(cache["v"]), flat(cache["pos"])]
    first_cache = len(ins) - 3
    body = functools.partial(_kernel, h=h, hkv=hkv, d=d, c=c, biased=biased)
    out_shape = [jax.ShapeDtypeStruct((q.size,), jnp.dtype(dtype))] + [
        jax.ShapeDtypeStruct((x.size,), x.dtype) for x in ins[first_cache:]]
    q_out, ck, cv, cp = pl.pallas_call(
        body, out_shape=out_shape, grid=(b, h + hkv),
        input_output_aliases={first_cache + n: 1 + n for n in range(3)},
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=cfg.interpret, name="decode_qkv",
    )(*ins)
    new = {"k": ck.reshape(cache["k"].shape), "v": cv.reshape(cache["v"].shape), "pos": cp.reshape(cache["pos"].shape)}
    return q_out.reshape(q.shape), new
