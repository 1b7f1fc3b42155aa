"""Batch-1 decode of a GPT-OSS spec, timed as `tessera run` times it, with lowering variants patched in.

Each variant replaces one function of the lowering before a fresh Program compiles its generate program,
so every variant runs in one process on the same weights, interleaved (`--rounds`), with CUDA graphs on
(the profiler's executable has them off, which inflates small kernels: docs/profile.md).

    python -m bench.experiments.decode_variants [--spec specs/gpt_oss_20b.yaml] [--new 32] [--only a,b]

Session 41: "pairs: XLA epilogues" times the decode kernels of moe_pairs.py against what they replace (XLA's small
fusions); "pairs epilogues N/W" the epilogues' program size (columns a program, warps). Session 42: "kv: two-row
products" (not yet timed) against XLA's unsplit column reduction of k and v.
"""

from __future__ import annotations

import argparse
import time

from tessera.run.environment import configure_allocator

configure_allocator()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.experiments.lowering_variants import patched  # noqa: E402
from bench.experiments.mxfp4_gemv_mma import MmaConfig, dispatching_tile  # noqa: E402
from tessera.lower import ops_nn  # noqa: E402
from tessera.lower.kernels import moe_pairs, moe_route, mxfp4_gemv  # noqa: E402
from tessera.lower.reference import moe  # noqa: E402

F32 = dict(preferred_element_type=jnp.float32)


def _route_rows2(x, *, router, router_bias, top_k, accum=None, route_blocks=None):
    # one token's router product as two rows: cuBLAS instead of XLA's column reduce
    pad = jnp.concatenate([x, x[:1]]) if x.shape[0] == 1 else x
    logits = jnp.einsum("td,de->te", pad, router.astype(x.dtype), **F32)[:x.shape[0]]
    return _finish(logits, router_bias, top_k)


def _route_wt(x, *, router, router_bias, top_k, accum=None, route_blocks=None):
    # over router.T: a row reduce (each expert's 2880 weights contiguous) if XLA keeps the transpose
    logits = jnp.einsum("td,ed->te", x, router.astype(x.dtype).T, **F32)
    return _finish(logits, router_bias, top_k)


def _route_einsum(x, *, router, router_bias, top_k, accum=None, route_blocks=None):
    # one einsum over the whole K, as before the blocked router (XLA orders the sum)
    logits = jnp.einsum("td,de->te", x, router.astype(x.dtype), **F32)
    return _finish(logits, router_bias, top_k)


def _route_f32(x, *, router, router_bias, top_k, accum=None, route_blocks=None):
    # an fp32 product of the exactly widened operands (same products, fp32 sums): an fp32 GEMV for XLA
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), router.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    return _finish(logits, router_bias, top_k)


def _route_bf16_out(x, *, router, router_bias, top_k, accum=None, route_blocks=None):
    # fp32 accumulation stored bf16 (as Hugging Face's bf16 router computes it), widened for top_k
    logits = jnp.einsum("td,de->te", x, router.astype(x.dtype), preferred_element_type=jnp.bfloat16)
    return _finish(logits.astype(jnp.float32), router_bias, top_k)


def _no_router(x, *, router, router_bias, top_k, accum=None, route_blocks=None):
    # ablation: experts 0..k-1 for every token, equal weights (x kept as an operand)
    logits = jnp.zeros((x.shape[0], top_k), jnp.float32) + x[:, :1].astype(jnp.float32) * 0
    experts = jnp.broadcast_to(jnp.arange(top_k, dtype=jnp.int32), (x.shape[0], top_k))
    return jax.nn.softmax(logits, axis=-1), experts


def _finish(logits, router_bias, top_k):
    if router_bias is not None:
        logits = logits + router_bias.astype(logits.dtype)
    top, experts = jax.lax.top_k(logits, top_k)
    return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)


_gemv_parts = mxfp4_gemv.gemv_parts


def _route_reference(blocks, bias, top_k, config=None):
    # the routing kernel's primitive as XLA's five small kernels (before 00917be)
    return moe.route_blocks(blocks, bias, top_k)


def _tensor_cores(block_n: int, weights_first: bool = False, num_warps: int = 4):
    # pair_dot's config on the tensor-core route (mxfp4_gemv_mma.py), its tile installed beside it
    def config(r, k, n, *, interpret=False):
        return MmaConfig(block_n=block_n, num_warps=num_warps, weights_first=weights_first, interpret=interpret)
    return [(mxfp4_gemv, "pair_config", config), (mxfp4_gemv, "_gemv_tile", dispatching_tile)]


def _gemv_fewer_splits(lhs, rhs, experts, cfg, out_dtype, *, per=1):
    import dataclasses
    return _gemv_parts(lhs, rhs, experts, dataclasses.replace(cfg, programs=264), out_dtype, per=per)


# Ablations (wrong tokens, for timing only): what a part of the layer costs with CUDA graphs on
def _no_gemv(lhs, rhs, experts, cfg, out_dtype):
    return jnp.zeros((lhs.shape[0], rhs.shape[-1]), out_dtype) + lhs[:, :1].astype(out_dtype)


def _no_gemv_parts(lhs, rhs, experts, cfg, out_dtype, *, per=1):
    mats = rhs if isinstance(rhs, tuple) else (rhs,)
    rows = jnp.repeat(lhs[:, :1], per, axis=0).astype(out_dtype)
    return jnp.zeros((1, len(mats), experts.shape[0], mats[0].shape[-1]), out_dtype) + rows[None, None]


def _pairs_xla_epilogues(x, weights, experts, **kw):
    # the experts' pairs as before moe_pairs.py: the pairs GEMV of each copy's row (the token broadcast to its k
    # copies), each split-K sum a reduce of its own, the bias, SwiGLU and combine XLA's
    from tessera.lower.kernels import mxfp4_matmul

    return moe.pairs_ffn(x, weights, experts, pair_dot=mxfp4_matmul.pair_dot, **kw)


def _pairs_block(block: int, warps: int):
    def ffn(x, weights, experts, **kw):
        return _PAIRS_FFN(x, weights, experts, config=moe_pairs.PairsConfig(block=block, num_warps=warps), **kw)
    return [(moe_pairs, "pairs_ffn", ffn)]


_PAIRS_FFN = moe_pairs.pairs_ffn


_WEIGHT_PRODUCT = ops_nn._weight_product


def _kv_two_rows(ctx, spec, x, w, store, name):
    """k and v of one token as products of two rows (the second zeros, behind a barrier XLA cannot simplify
    through): XLA rewrites a vector times a weight of < 10 M elements into a reduce (a column reduction,
    unsplit in deterministic mode: 4.5 us for k and v at 20b), but leaves a two-row product to its GEMMs."""
    if name in ("k", "v") and spec == "bse,ehd->bshd" and x.shape[0] * x.shape[1] == 1:
        rows = jax.lax.optimization_barrier(jnp.concatenate([x, jnp.zeros_like(x)], axis=1))
        return _WEIGHT_PRODUCT(ctx, spec, rows, w, store, name)[:, :1]
    return _WEIGHT_PRODUCT(ctx, spec, x, w, store, name)


def _no_moe(x, **kw):
    return x * 0


VARIANTS = {
    "base": [],
    "router rows2": [(moe, "route", _route_rows2)],
    "router w.T": [(moe, "route", _route_wt)],
    "router einsum": [(moe, "route", _route_einsum)],
    "router f32": [(moe, "route", _route_f32)],
    "router bf16 out": [(moe, "route", _route_bf16_out)],
    "ablate: no router": [(moe, "route", _no_router)],
    "gemv 264 programs": [(mxfp4_gemv, "gemv_parts", _gemv_fewer_splits)],
    "routing: reference": [(moe_route, "route_blocks", _route_reference)],
    "gemv mma n256": _tensor_cores(256),
    "gemv mma n512": _tensor_cores(512),
    "gemv mma n256 wf": _tensor_cores(256, True),
    "gemv mma n512 wf": _tensor_cores(512, True),
    "ablate: no expert gemv": [(mxfp4_gemv, "gemv", _no_gemv), (mxfp4_gemv, "gemv_parts", _no_gemv_parts)],
    "kv: two-row products": [(ops_nn, "_weight_product", _kv_two_rows)],
    "pairs: XLA epilogues": [(moe_pairs, "pairs_ffn", _pairs_xla_epilogues)],
    **{f"pairs epilogues {b}/{w}": _pairs_block(b, w) for b, w in ((16, 1), (32, 1), (64, 1), (128, 1), (256, 2))},
    "ablate: no moe": [(moe, "moe_pairs", _no_moe)],
}


def main(argv=None) -> int:
    from tessera.lower import program
    from tessera.lower.program import compile_experiment
    from tessera.spec import load_experiment

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="specs/gpt_oss_20b.yaml")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=None)
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    exp = load_experiment(args.spec)
    first = getattr(exp.task, "prompts", None) or [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    prompt = np.asarray([first[0]] * args.batch, np.int32)
    base = compile_experiment(exp)
    params = base.init(0, split_layers=True)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {args.spec}, batch {args.batch}, "
          f"{args.new} new tokens", flush=True)
    progs, ref = {}, None
    for name in names:
        with patched(VARIANTS[name]):
            program._PROGRAMS.clear()  # a Program of its own: programs are cached on the spec's hash
            prog = compile_experiment(exp)
            t = time.perf_counter()
            out = np.asarray(prog.generate(params, prompt, max_new_tokens=args.new))
            compile_s = time.perf_counter() - t
        ref = out if ref is None else ref
        progs[name] = prog
        print(f"{name:<20} compiled in {compile_s:5.1f} s; tokens equal the first variant's: "
              f"{bool((out == ref).all())}", flush=True)
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name in names:
            prog = progs[name]
            times = {}
            for n in (args.new, 1):
                ts = []
                for _ in range(3):
                    t = time.perf_counter()
                    jax.block_until_ready(prog.generate(params, prompt, max_new_tokens=n, capacity=args.new))
                    ts.append(time.perf_counter() - t)
                times[n] = min(ts)
            step = (times[args.new] - times[1]) / (args.new - 1)
            best[name] = min(best.get(name, float("inf")), step)
    for name in names:
        print(f"{name:<20} {best[name] * 1e3:7.3f} ms a token  {args.batch / best[name]:8.1f} tok/s  "
              f"{best['base' if 'base' in best else names[0]] / best[name]:5.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
