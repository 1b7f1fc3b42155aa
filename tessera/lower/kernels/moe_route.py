"""A decode step's routing in one kernel (Pallas, Triton backend): `reference.moe.route_blocks`.

After the router's product (its partial sums [T, C, E], which XLA computes fused with the norm before it), the
reference's routing is five small XLA kernels a layer on the GPU: the sum over C, each expert's rank, the slot
of each rank, the softmax's maximum and the softmax. Each is a launch of ~1.3 us for a few hundred values;
here one program a token does all five. Exactly the reference's choices (ranks in `choose_top_k`'s total
order); the sum over C is a tree, so a logit may differ from XLA's in its last bit, as XLA's own order differs
from device to device, and the softmax's exponential is Triton's, within a few ulps of XLA's (the GPU test
holds the weights to 1e-5 relative where the logits are exact).

GPT-OSS-20B batch-1 decode on one H100 (jax 0.11.2, `python -m bench.e2e --rows "20b decode b1"`, one device
call, a process each): 404.9 tok/s with the five XLA kernels, 428.8 with this one (1.06x; 50 -> 53 % of the
810 tok/s roofline).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tessera.lower.kernels._vma import common, out_struct
from tessera.lower.kernels.mxfp4_matmul import _on_gpu

EXPERTS_MAX = 128  # a program holds the [E, E] comparisons in registers (128 x 128 over 4 warps: 128 a thread)


@dataclasses.dataclass(frozen=True)
class RouteConfig:
    """One program a token of `num_warps` warps; `interpret` runs it on the CPU (tests)."""
    num_warps: int = 4
    interpret: bool = False


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def supported(blocks, bias, top_k: int, config: RouteConfig | None = None) -> bool:
    """GPU (or the interpreter), fp32 blocks [T, C, E] with E <= EXPERTS_MAX, bias [E] or None, 1 <= k <= E."""
    if not ((config is not None and config.interpret) or _on_gpu()):
        return False
    if blocks.ndim != 3 or blocks.dtype != jnp.float32:
        return False
    t, c, e = blocks.shape
    if bias is not None and (bias.shape != (e,) or not jnp.issubdtype(bias.dtype, jnp.floating)):
        return False
    return 1 <= top_k <= e <= EXPERTS_MAX and blocks.size < 2**31


def _route_kernel(blocks_ref, bias_ref, w_ref, e_ref, *, c: int, e: int, k: int):
    t = pl.program_id(0)
    cp, ep, kp = _pow2(c), _pow2(e), _pow2(k)
    rows, ids = jnp.arange(cp, dtype=jnp.int32), jnp.arange(ep, dtype=jnp.int32)
    real = ids < e
    blk = pltriton.load(blocks_ref.at[(t * c + rows[:, None]) * e + ids[None, :]],
                        mask=(rows[:, None] < c) & real[None, :], other=0.0)
    logits = jnp.sum(blk, axis=0)  # [ep]
    if bias_ref is not None:
        logits = logits + pltriton.load(bias_ref.at[ids], mask=real, other=0.0).astype(jnp.float32)
    # choose_top_k's total order: the fp32 bits, negatives' magnitude flipped, compared as int32
    bits = lax.bitcast_convert_type(logits, jnp.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    mine, other = key[:, None], key[None, :]
    beats = ((other > mine) | ((other == mine) & (ids[None, :] < ids[:, None]))) & real[None, :]
    rank = jnp.sum(beats.astype(jnp.int32), axis=1)  # [ep]: how many real experts beat each
    slots = jnp.arange(kp, dtype=jnp.int32)
    chosen = (rank[None, :] == slots[:, None]) & real[None, :]  # [kp, ep]: one expert a slot below k
    values = jnp.max(jnp.where(chosen, logits[None, :], -jnp.inf), axis=1)  # [kp]
    experts = jnp.max(jnp.where(chosen, ids[None, :], -1), axis=1)
    live = slots < k
    top = jnp.max(jnp.where(live, values, -jnp.inf))
    unnormalized = jnp.where(live, jnp.exp(values - top), 0.0)  # jax.nn.softmax's arithmetic
    weights = unnormalized / jnp.sum(unnormalized)
    pltriton.store(w_ref.at[t * k + slots], weights, mask=live)
    pltriton.store(e_ref.at[t * k + slots], experts, mask=live)


def route_blocks(blocks, bias, top_k: int, *, config: RouteConfig | None = None):
    """`reference.moe.route_blocks(blocks [T, C, E], bias [E] | None, top_k)` -> (weights fp32 [T, k], experts
    int32 [T, k]), one program a token."""
    cfg = config or RouteConfig()
    t, c, e = blocks.shape
    args = [blocks.reshape(-1)] + ([] if bias is None else [bias])
    args = list(common(*args))
    body = functools.partial(_route_kernel, c=c, e=e, k=top_k)
    if bias is None:
        body = functools.partial(lambda f, b, w, x: f(b, None, w, x), body)
    weights, experts = pl.pallas_call(
        body,
        out_shape=(out_struct((t * top_k,), jnp.float32, *args), out_struct((t * top_k,), jnp.int32, *args)),
        grid=(t,),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=cfg.interpret,
        name="moe_route",
    )(*args)
    return weights.reshape(t, top_k), experts.reshape(t, top_k)
