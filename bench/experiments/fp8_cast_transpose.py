"""SwiGLU's gradient quantised to e5m2 in both layouts in one pass (tessera/lower/kernels/fp8_cast.py, Pallas on
Triton), against XLA's fusions of the same reference.

    python -m bench.experiments.fp8_cast_transpose [--m 16384] [--f 8192] [--logits 16384x128256] [--check]

In an fp8 train step the MLP's backward takes the gradient dh of SwiGLU's output h = silu(gate) * up, forms the
gradients of gate and up, and quantises each to e5m2 (delayed scaling) in the row layout the input gradient's GEMM
reads and in the transposed, token-minor, layout the weight gradient's GEMM reads (cuBLASLt's fp8 GEMMs take both
operands contiguous along K), with each gradient's amax for the history. XLA made that one multi-output fusion of
1,165 us a layer at the Llama-1B shape (16,384 tokens x 8,192) in the session-45 profile of the step, ~2.5x the
time of its bytes (768 MiB read, 512 MiB written) at the copy rate, after a pass for the amaxes.

Variants timed on the same inputs (GPU microseconds a call, bench.timing.time_jax), each with histories that hold a
range (a step after the first) unless named "first step" (empty histories: the scale from the current amax):
- "xla": `reference.fp8_cast.swiglu_grad_delayed` jitted (the built step's form: the amax, then the casts);
- "xla, history only": the scale from the history alone, no fallback to the amax (XLA may fuse the amax into the
  casting pass);
- "pallas BMxBN" (and "... first step"): the kernel at that tile.
`--check` compares each kernel's outputs with the reference's (codes equal but where the fp32 gradients differ in
their last bits across a rounding boundary; amaxes within a bf16 rounding).

A second table (`--logits M x N`, the Llama-1B step's 16,384 x 128,256 by default) does the same for a materialised
gradient, `cast_transpose_delayed` (the unembedding's logits gradient: 7.0 ms for XLA's fusion and 3.0 ms for its
amax in the session-45 profile).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from bench.experiments.lowering_variants import history_only, patched
from tessera.lower.kernels import fp8_cast
from tessera.lower.reference import fp8, fp8_cast as reference

E5M2 = jnp.float8_e5m2


def _history_only(fn):
    """`fn` with delayed scaling's fallback to the current amax turned off (the scale from the row alone), while it
    is traced."""
    def call(*args):
        with patched([(fp8, "quantize_delayed", history_only)]):
            return fn(*args)
    return call


def inputs(m: int, f: int, seed: int = 0, first: bool = False):
    """dh, gate, up (bf16 [m, f], gradients at a mean loss's scale), gradient rows [2, 16] (empty if `first`, else
    holding ranges near the gradients' own) and h's scale."""
    k = jax.random.split(jax.random.key(seed), 3)
    gate = jax.random.normal(k[0], (m, f), jnp.bfloat16)
    up = jax.random.normal(k[1], (m, f), jnp.bfloat16)
    dh = (1e-4 * jax.random.normal(k[2], (m, f), jnp.float32)).astype(jnp.bfloat16)
    rows = jnp.zeros((2, 16), jnp.float32)
    h_scale = jnp.float32(2.0 ** 6)  # the down product's input scale: SwiGLU's output coded again, transposed
    return dh, gate, up, rows if first else rows.at[:, 3].set(jnp.asarray([3e-4, 5e-4])), h_scale


def compare(got, want) -> dict:
    """Each coded output's mismatches against `want`'s (count, largest distance in e5m2 steps), keyed by position
    (SwiGLU's: gate, gate.T, up, up.T, then h.T in e4m3), and the amaxes (got, want)."""
    out, amax = {}, []
    for i, (a, b) in enumerate(zip(got, want)):
        if a.dtype in (E5M2, jnp.float8_e4m3fn):
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
    ap.add_argument("--tiles", default="64x128,128x64,64x64,128x128", help="bm x bn of the Pallas variants")
    ap.add_argument("--logits", default="16384x128256", help="M x N of the plain cast-transpose table ('' skips)")
    args = ap.parse_args(argv)
    _table(args, "SwiGLU's gradient", lambda first: inputs(args.m, args.f, first=first),
           3 * 2 * args.m * args.f + 5 * args.m * args.f, reference.swiglu_grad_delayed,
           fp8_cast.swiglu_grad_delayed)
    if args.logits:
        m, n = (int(v) for v in args.logits.split("x"))
        g = (1e-6 * jax.random.normal(jax.random.key(1), (m, n), jnp.float32)).astype(jnp.bfloat16)
        _table(args, "the logits' gradient", lambda first: (g, jnp.zeros((16,)) if first else
                                                            jnp.zeros((16,)).at[2].set(4e-6)),
               2 * m * n + 2 * m * n, reference.cast_transpose_delayed, fp8_cast.cast_transpose_delayed)
    return 0


def _table(args, what, make, moved, ref, kernel):
    """Time the reference (as built and history only) and the kernel at every tile of `--tiles`, on histories with a
    range and (the kernel's) empty ones; `moved`: bytes read and written (the rate printed); with `--check` each
    kernel's outputs against the reference's."""
    from bench.timing import time_jax

    steady, first = make(False), make(True)
    shape = "x".join(str(d) for d in steady[0].shape)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {what} [{shape}], {moved / 2**20:.0f} MiB",
          flush=True)
    variants = {"xla": (ref, steady), "xla, history only": (_history_only(ref), steady),
                "xla first step": (ref, first)}
    for t in args.tiles.split(","):
        bm, bn = (int(v) for v in t.split("x"))
        fn = functools.partial(kernel, config=fp8_cast.CastConfig(bm=bm, bn=bn))
        variants[f"pallas {t}"] = (fn, steady)
        variants[f"pallas {t} first step"] = (fn, first)
    wants = {id(steady): jax.jit(ref)(*steady), id(first): jax.jit(ref)(*first)} if args.check else {}
    for name, (fn, a) in variants.items():
        try:
            ms = time_jax(fn, *a)
        except Exception as exc:  # a tiling Triton refuses is a result, not the end of the table
            print(f"{name:<26} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        line = f"{name:<26} {ms * 1e3:8.1f} us  {moved / ms / 1e6:7.0f} GB/s"
        if wants and name.startswith("pallas"):
            line += f"  {compare(jax.jit(fn)(*a), wants[id(a)])}"
        print(line, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
