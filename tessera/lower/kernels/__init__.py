"""Pallas (Mosaic GPU, Hopper) kernels, each beside the reference it matches.

| module | public op | fallback test |
|---|---|---|
| flash_attention | flash_attention(q, k, v, *, sinks, causal, window, scale, q_offset, config) | supported(...) |
| decode_attention | decode_attention(q, k, v, *, kv_len, q_offset, sinks, causal, window, scale, config) | supported(...) |
| grouped_matmul | grouped_matmul(lhs, rhs, group_sizes, *, config) | supported(...) |
| mxfp4_matmul (Triton backend) | ragged_dot(lhs, rhs: MXFP4, group_sizes, *, preferred_element_type, config), matmul(x, w, *, config), pair_dot(lhs, rhs: MXFP4 or a tuple of them, experts, *, preferred_element_type, config) | supported(...), supported_pairs(...) |
| mxfp4_gemv (Triton backend) | the matrix-vector kernel behind mxfp4_matmul.pair_dot and moe_pairs at decode | (through them) |
| moe_pairs (Triton backend) | pairs_ffn(x, weights, experts, *, gate, up, down, biases, act, config): decode's experts after the routing | supported(...) |
| fp8_cast (Triton backend) | swiglu_grad_delayed(dh, gate, up, rows, h_scale, *, config), cast_transpose_delayed(g, row, *, config): gradients to e5m2 codes in both layouts with their amaxes, in one pass | supported(...), fitted(...) |
| fp8_gemv (Triton backend) | weight_only_einsum(spec, x, w: FP8Blocks, *, out_dtype, config): one token times block-scaled fp8 weights | supported(...) |
| moe_route (Triton backend) | route_blocks(blocks, bias, top_k, *, config): a decode step's routing after the router's product | supported(...) |

Each `supported()` is False without its GPU (unless a config asks for the CPU interpreter): Hopper
for the Mosaic GPU kernels, compute capability 8.0+ for the Triton ones;
the lowering keeps the `jax.numpy` reference there. Modules import Pallas lazily: import them only
where a kernel may run.

Below: what each kernel implements, as entries of the lowering table (tessera/lower/table.py), which is how
a lowering reaches a kernel. Kernels no lowering selects live in bench/experiments/ (a fused RMSNorm, the
fused gate/up grouped GEMM + SwiGLU), with docs/kernels-log.md saying why.
"""


# ----------------------------------------------------------------------------- what each kernel implements
# The lowering table's kernels (tessera/lower/table.py): each primitive with its reference, each kernel with
# the test of its operands. Kernel modules are imported only when a kernel may run (auto, on its backend).

from tessera.lower import table as _table  # noqa: E402
from tessera.lower.reference import fp8_blocks as _fp8_blocks  # noqa: E402
from tessera.lower.reference import fp8_cast as _fp8_cast  # noqa: E402
from tessera.lower.reference import moe as _moe  # noqa: E402
from tessera.lower.reference import mxfp4 as _mxfp4  # noqa: E402
from tessera.lower.reference.attention import attention as _attention_reference  # noqa: E402


def _decode_reference(q, cache, q_pos, *, sinks, causal, window, scale, accum=None):
    """New tokens q [B, S, H, D] at absolute positions q_pos [B] against a KV cache that holds them."""
    return _attention_reference(q, cache["k"], cache["v"], sinks=sinks, causal=causal, window=window, scale=scale,
                                q_offset=q_pos, kv_positions=cache["pos"], accum=accum)


_table.primitive("attention", _attention_reference)  # queries at q_offset + 0..S-1 over keys 0..T-1
_table.primitive("decode_attention", _decode_reference)
_table.primitive("ragged_dot", _mxfp4.any_ragged_dot)  # the experts' grouped products (rhs plain or MXFP4)
_table.primitive("pairs_ffn", _moe.pairs_ffn)  # decode's few (token, expert) copies after the routing
_table.primitive("weight_only_einsum", _fp8_blocks.weight_only_einsum)  # one token times held fp8 blocks
_table.primitive("route_blocks", _moe.route_blocks)  # the router's partial sums -> top-k experts, weights
_table.primitive("swiglu_grad_delayed", _fp8_cast.swiglu_grad_delayed)  # SwiGLU's gradients to e5m2, both layouts
_table.primitive("cast_transpose_delayed", _fp8_cast.cast_transpose_delayed)  # a product's gradient so


def _flash_takes(q, k, v, *, sinks, causal, window, scale, q_offset=0):
    from tessera.lower.kernels import flash_attention as fa

    if not isinstance(q_offset, int):  # context parallel: the offset depends on the device, the kernel's is static
        return "queries at a per-device offset (context parallel)"
    return fa.supported(q, k, v, sinks=sinks, causal=causal, window=window, q_offset=q_offset) \
        or "shapes or dtypes outside flash_attention"


@_table.kernel("attention", name="flash_attention (Pallas, Mosaic GPU)", when=_flash_takes, in_shard_map=True)
def _flash(q, k, v, *, sinks, causal, window, scale, q_offset=0):
    from tessera.lower.kernels import flash_attention as fa

    return fa.flash_attention(q, k, v, sinks=sinks, causal=causal, window=window, scale=scale, q_offset=q_offset)


def _decode_takes(q, cache, q_pos, **_):
    from tessera.lower.kernels import decode_attention as da

    return (q.shape[1] == 1 and da.supported(q, cache["k"], cache["v"])) \
        or "shapes or dtypes outside decode_attention"


@_table.kernel("decode_attention", name="decode_attention (Pallas, Mosaic GPU)", when=_decode_takes)
def _decode(q, cache, q_pos, *, sinks, causal, window, scale):
    import jax.numpy as jnp

    from tessera.lower.kernels import decode_attention as da

    # the cache fills slots 0, 1, ... in order (a ring of `window` slots for sliding layers): the valid
    # slots are a prefix, and every one of them is visible to the newest token
    kv_len = jnp.minimum(q_pos + 1, cache["k"].shape[1]).astype(jnp.int32)
    return da.decode_attention(q, cache["k"], cache["v"], kv_len=kv_len, sinks=sinks, causal=False, window=None,
                               scale=scale)


def _mxfp4_takes(lhs, rhs, group_sizes, preferred_element_type=None):
    from tessera.lower.kernels import mxfp4_matmul as mk

    if not isinstance(rhs, _mxfp4.MXFP4):
        return False
    return mk.supported(lhs, rhs, group_sizes) or "MXFP4 experts outside mxfp4_ragged_dot (dequantised)"


@_table.kernel("ragged_dot", name="mxfp4_ragged_dot (Pallas, Triton: dequantised in registers)", when=_mxfp4_takes,
               in_shard_map=True)  # verified with grouped_matmul
def _mxfp4_ragged(lhs, rhs, group_sizes, preferred_element_type=None):
    from tessera.lower.kernels import mxfp4_matmul as mk

    return mk.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


def _grouped_takes(lhs, rhs, group_sizes, preferred_element_type=None):
    from tessera.lower.kernels import grouped_matmul as gm

    if isinstance(rhs, _mxfp4.MXFP4):
        return False
    return gm.supported(lhs, rhs, group_sizes) or "shapes or dtypes outside grouped_matmul"


@_table.kernel("ragged_dot", name="grouped_matmul (Pallas, Mosaic GPU)", when=_grouped_takes, in_shard_map=True)
def _grouped(lhs, rhs, group_sizes, preferred_element_type=None):
    from tessera.lower.kernels import grouped_matmul as gm

    out = gm.grouped_matmul(lhs, rhs, group_sizes)
    return out.astype(preferred_element_type or out.dtype)


def _pairs_takes(x, weights, experts, *, gate, up, down, **_):
    from tessera.lower.kernels import moe_pairs

    if not all(isinstance(m, _mxfp4.MXFP4) for m in (gate, up, down)):
        return "plain experts: each (token, expert) pair gathers its expert"
    return (moe_pairs.supported(x, weights, experts, gate=gate, up=up, down=down)
            or "MXFP4 experts outside mxfp4_pair_gemv (dequantised)")


@_table.kernel("pairs_ffn", name="mxfp4_pair_gemv and its epilogues over (token, expert) pairs (Pallas, Triton)",
               when=_pairs_takes)
def _pairs(x, weights, experts, **kw):
    from tessera.lower.kernels import moe_pairs

    return moe_pairs.pairs_ffn(x, weights, experts, **kw)


def _route_takes(blocks, bias, top_k):
    from tessera.lower.kernels import moe_route

    return moe_route.supported(blocks, bias, top_k) or "more than 128 experts, or not fp32 sums"


@_table.kernel("route_blocks", name="moe_route (Pallas, Triton)", when=_route_takes)
def _route(blocks, bias, top_k):
    from tessera.lower.kernels import moe_route

    return moe_route.route_blocks(blocks, bias, top_k)


def _fp8_gemv_takes(spec, x, w, **kw):
    from tessera.lower.kernels import fp8_gemv

    return fp8_gemv.supported(spec, x, w, **kw)


@_table.kernel("weight_only_einsum", name="fp8_block_gemv (Pallas, Triton)", when=_fp8_gemv_takes)
def _fp8_gemv(spec, x, w, *, compute_dtype, out_dtype):
    from tessera.lower.kernels import fp8_gemv

    return fp8_gemv.weight_only_einsum(spec, x, w, compute_dtype=compute_dtype, out_dtype=out_dtype)


# The fp8_cast kernels run inside train steps on Hopper. Measured in one device call (one H200, jax 0.11.2, the
# Llama-1B shape at batch 8 x 2048, delayed(16) with the unembedding in fp8; session 48): SwiGLU's gradient pass
# 593 us against XLA's fusion's 1,317, the logits' gradient 2,395 against 5,103, the train step 204.9 ms against
# 217.7 (bench.experiments.train_variants, "xla casts"). False keeps the references (XLA's fusions of the same).
FP8_CAST_IN_STEPS = True
_TURNED_OFF = "turned off (kernels.FP8_CAST_IN_STEPS)"


def _fp8_cast_takes(*operands, swiglu: bool = False):
    from tessera.lower.kernels import fp8_cast

    if not FP8_CAST_IN_STEPS:
        return _TURNED_OFF
    config = fp8_cast.fitted(*operands[0].shape, fp8_cast.SWIGLU if swiglu else fp8_cast.DEFAULT)  # as it runs
    return (config is not None and fp8_cast.supported(*operands, config=config)) \
        or "shapes or dtypes outside fp8_cast (whole tiles of 16 or more, on Hopper)"


def _swiglu_cast_takes(dh, gate, up, rows, h_scale):
    return _fp8_cast_takes(dh, gate, up, swiglu=True)


@_table.kernel("swiglu_grad_delayed", name="fp8_cast swiglu gradient (Pallas, Triton)", when=_swiglu_cast_takes)
def _swiglu_cast(dh, gate, up, rows, h_scale):
    from tessera.lower.kernels import fp8_cast

    return fp8_cast.swiglu_grad_delayed(dh, gate, up, rows, h_scale, config=fp8_cast.fitted(*dh.shape, fp8_cast.SWIGLU))


def _cast_takes(g, row):
    return _fp8_cast_takes(g)


@_table.kernel("cast_transpose_delayed", name="fp8_cast (Pallas, Triton)", when=_cast_takes)
def _cast(g, row):
    from tessera.lower.kernels import fp8_cast

    return fp8_cast.cast_transpose_delayed(g, row, config=fp8_cast.fitted(*g.shape))
