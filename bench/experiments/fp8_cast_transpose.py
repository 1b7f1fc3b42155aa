"""SwiGLU's gradient quantised to e5m2 in both layouts in one pass (Pallas, Triton backend), against XLA's fusion.

    python -m bench.experiments.fp8_cast_transpose [--m 16384] [--f 8192] [--logits 16384x128256] [--check]

In an fp8 train step the MLP's backward takes the gradient dh of SwiGLU's output h = silu(gate) * up, forms the
gradients of gate and up, and quantises each to e5m2 (delayed scaling: a scale known beforehand) in the row layout
the input gradient's GEMM reads and in the transposed, token-minor, layout the weight gradient's GEMM reads
(cuBLASLt's fp8 GEMMs take both operands contiguous along K), with each gradient's amax for the history. XLA makes
that one multi-output fusion: 1,165 us a layer at the Llama-1B shape (16,384 tokens x 8,192) in the session-45
profile of the step, ~2.5x the time of its bytes (768 MiB read, 512 MiB written) at the copy rate.

Variants timed on the same inputs (GPU milliseconds a call, bench.timing.time_jax):
- "xla": the step's form (the VJP of reference/activations.swiglu, then `quantize` with the given scale, `.T`);
- "xla, barrier": the same with the quantised values behind an optimization barrier before their transposes, so
  the transposes are copies of their own (bench.experiments.train_variants "barrier before weight gradient");
- "pallas": `swiglu_grad_e5m2`, one program per [bm, bf] tile: reads dh, gate, up once, writes both codes in both
  layouts and the tile's two amaxes.
`--check` compares the kernel with the step's form (codes equal but where the fp32 gradients differ in their last
bits across a rounding boundary; amaxes within a bf16 rounding).

A second table (`--logits M x N`, the Llama-1B step's 16,384 x 128,256 by default) times the plain form for the
unembedding's logits gradient, `cast_transpose_e5m2`: a materialised bf16 gradient to codes in both layouts and its
amax, against XLA's (the step's fusion computes the gradient from the logits as well: 7.0 ms, and 3.0 ms for its
amax, in the session-45 profile).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tessera.lower.reference import activations, fp8

E5M2 = jnp.float8_e5m2
BIG = float(jnp.finfo(E5M2).max)


def _codes(x, s):
    """x (fp32) times the power of two s, saturated and rounded to e5m2 (reference/fp8.quantize_delayed's cast)."""
    return jnp.clip(x * s, -BIG, BIG).astype(E5M2)


def _kernel(s_ref, dh_ref, g_ref, u_ref, gq_ref, gt_ref, uq_ref, ut_ref, ga_ref, ua_ref):
    g = g_ref[...].astype(jnp.float32)
    u = u_ref[...].astype(jnp.float32)
    dh = dh_ref[...].astype(jnp.float32)
    sig = jax.nn.sigmoid(g)
    # the VJP of (g * sigmoid(g) * u) in fp32, each gradient rounded to the gradients' type as the step's are
    dg = (dh * u * (sig + g * sig * (1.0 - sig))).astype(dh_ref.dtype).astype(jnp.float32)
    du = (dh * (g * sig)).astype(dh_ref.dtype).astype(jnp.float32)
    qg, qu = _codes(dg, s_ref[0]), _codes(du, s_ref[1])
    gq_ref[...] = qg
    gt_ref[...] = qg.T
    uq_ref[...] = qu
    ut_ref[...] = qu.T
    ga_ref[...] = jnp.max(jnp.abs(dg)).reshape(1, 1)
    ua_ref[...] = jnp.max(jnp.abs(du)).reshape(1, 1)


def _tiled(kernel, scales, *operands, codes: int, bm: int, bn: int, num_warps: int, interpret: bool):
    """`kernel` over [bm, bn] tiles of the [M, N] `operands` (bf16) with `scales` (fp32, read whole): its outputs are
    `codes` pairs of e5m2 codes [M, N] and their transpose [N, M], then one fp32 amax per code a tile, reduced here
    to one each. Returns (code, transpose) * codes, then the amaxes."""
    m, n = operands[0].shape
    if m % bm or n % bn:
        raise ValueError(f"[{m}, {n}] is not a whole number of [{bm}, {bn}] tiles")
    grid = (m // bm, n // bn)
    tile, tile_t = pl.BlockSpec((bm, bn), lambda i, j: (i, j)), pl.BlockSpec((bn, bm), lambda i, j: (j, i))
    one = pl.BlockSpec((1, 1), lambda i, j: (i, j))
    pair = [jax.ShapeDtypeStruct((m, n), E5M2), jax.ShapeDtypeStruct((n, m), E5M2)]
    compiler = {} if interpret else {"compiler_params": _triton(num_warps)}
    out = pl.pallas_call(
        kernel, grid=grid,
        in_specs=[pl.BlockSpec(scales.shape, lambda i, j: (0,)), *[tile] * len(operands)],
        out_specs=[tile, tile_t] * codes + [one] * codes,
        out_shape=pair * codes + [jax.ShapeDtypeStruct(grid, jnp.float32)] * codes, interpret=interpret, **compiler,
    )(scales.astype(jnp.float32), *operands)
    return (*out[:2 * codes], *(jnp.max(a) for a in out[2 * codes:]))


def swiglu_grad_e5m2(dh, gate, up, scales, *, bm: int = 64, bf: int = 128, num_warps: int = 4,
                     interpret: bool = False):
    """SwiGLU's gradients quantised: dh, gate, up [M, F] (bf16), scales fp32 [2] (gate's, up's) ->
    (gate codes [M, F], their transpose [F, M], up codes, their transpose (e5m2), amax |d gate|, amax |d up|)."""
    return _tiled(_kernel, scales, dh, gate, up, codes=2, bm=bm, bn=bf, num_warps=num_warps, interpret=interpret)


def _cast_kernel(s_ref, x_ref, q_ref, t_ref, a_ref):
    x = x_ref[...].astype(jnp.float32)
    q = _codes(x, s_ref[0])
    q_ref[...] = q
    t_ref[...] = q.T
    a_ref[...] = jnp.max(jnp.abs(x)).reshape(1, 1)


def cast_transpose_e5m2(x, scale, *, bm: int = 64, bn: int = 128, num_warps: int = 4, interpret: bool = False):
    """x [M, N] (a gradient, bf16) quantised to e5m2 with the power of two `scale` (fp32 [1]): (codes [M, N], their
    transpose [N, M], amax |x|) in one pass: the unembedding's logits gradient, whose weight gradient's GEMM reads it
    token-minor (in the session-45 step XLA's fusion took 7.0 ms after a 3.0 ms amax pass at 16,384 x 128,256)."""
    return _tiled(_cast_kernel, scale, x, codes=1, bm=bm, bn=bn, num_warps=num_warps, interpret=interpret)


def cast_reference(x, scale, barrier: bool = False):
    """XLA's form: quantise, transpose, amax."""
    q = _codes(x.astype(jnp.float32), scale[0])
    if barrier:
        q = jax.lax.optimization_barrier(q)
    return q, q.T, fp8._amax(x)


def _triton(num_warps: int):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=1)


def reference(dh, gate, up, scales, barrier: bool = False):
    """The step's form: the VJP of reference/activations.swiglu, each gradient quantised and transposed."""
    _, vjp = jax.vjp(activations.swiglu, gate, up)
    dg, du = vjp(dh)
    qg, qu = _codes(dg.astype(jnp.float32), scales[0]), _codes(du.astype(jnp.float32), scales[1])
    if barrier:
        qg, qu = jax.lax.optimization_barrier((qg, qu))
    return qg, qg.T, qu, qu.T, fp8._amax(dg), fp8._amax(du)


def inputs(m: int, f: int, seed: int = 0):
    """dh, gate, up (bf16 [m, f], gradients at a mean loss's scale) and power-of-two scales that fit them."""
    k = jax.random.split(jax.random.key(seed), 3)
    gate = jax.random.normal(k[0], (m, f), jnp.bfloat16)
    up = jax.random.normal(k[1], (m, f), jnp.bfloat16)
    dh = (1e-4 * jax.random.normal(k[2], (m, f), jnp.float32)).astype(jnp.bfloat16)
    return dh, gate, up, jnp.asarray([2.0 ** 22, 2.0 ** 22], jnp.float32)


def compare(got, want) -> dict:
    """Each coded output's mismatches against `want`'s (count, largest distance in e5m2 steps), keyed by position
    (SwiGLU's: gate, gate.T, up, up.T), and the amaxes (got, want)."""
    out, amax = {}, []
    for i, (a, b) in enumerate(zip(got, want)):
        if a.dtype == E5M2:
            ia = jax.lax.bitcast_convert_type(a, jnp.uint8).astype(jnp.int32)
            ib = jax.lax.bitcast_convert_type(b, jnp.uint8).astype(jnp.int32)
            out[i] = (int(jnp.sum(ia != ib)), int(jnp.max(jnp.abs(ia - ib))))
        else:
            amax.append((float(a), float(b)))
    out["amax"] = amax
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--f", type=int, default=8192)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--tiles", default="64x128,128x64,64x64,128x128", help="bm x bf of the Pallas variants")
    ap.add_argument("--logits", default="16384x128256", help="M x N of the plain cast-transpose table ('' skips)")
    args = ap.parse_args(argv)
    _table(args, "SwiGLU's gradient", inputs(args.m, args.f), 3 * 2 * args.m * args.f + 4 * args.m * args.f,
           {"xla": reference, "xla, barrier": functools.partial(reference, barrier=True)}, swiglu_grad_e5m2,
           "bf")
    if args.logits:
        m, n = (int(v) for v in args.logits.split("x"))
        g = (1e-6 * jax.random.normal(jax.random.key(1), (m, n), jnp.float32)).astype(jnp.bfloat16)
        _table(args, "the logits' gradient", (g, jnp.asarray([2.0 ** 26], jnp.float32)), 2 * m * n + 2 * m * n,
               {"xla": cast_reference, "xla, barrier": functools.partial(cast_reference, barrier=True)},
               cast_transpose_e5m2, "bn")
    return 0


def _table(args, what, args_, moved, variants, kernel, minor: str):
    """Time each of `variants` and the kernel at every tile of `--tiles` on `args_`; `moved`: bytes read and
    written (the rate printed); with `--check` the kernel's codes against the first variant's."""
    from bench.timing import time_jax

    shape = "x".join(str(d) for d in args_[0].shape)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {what} [{shape}], {moved / 2**20:.0f} MiB",
          flush=True)
    variants = dict(variants)
    first = next(iter(variants.values()))
    for t in args.tiles.split(","):
        bm, bn = (int(v) for v in t.split("x"))
        variants[f"pallas {t}"] = functools.partial(kernel, bm=bm, **{minor: bn})
    want = jax.jit(first)(*args_) if args.check else None
    for name, fn in variants.items():
        try:
            ms = time_jax(fn, *args_)
        except Exception as exc:  # a tiling Triton refuses is a result, not the end of the table
            print(f"{name:<16} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        line = f"{name:<16} {ms * 1e3:8.1f} us  {moved / ms / 1e6:7.0f} GB/s"
        if want is not None and name.startswith("pallas"):
            line += f"  {compare(jax.jit(fn)(*args_), want)}"
        print(line, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
