"""Grouped-GEMM kernel variants on the GPT-OSS expert shapes: GPU checks and timings, one table.

    python -m bench.moe_variants [--part check,fwd,bwd,fused]

`check` compares forward, d lhs, d rhs and the fused SwiGLU with their references on fresh random
inputs (relative L2 error, bf16 operands: < 1e-2). The other parts time tile/pipeline variants on
32768 rows routed over 128 experts (2880 -> 5760, and the fused gate/up 2880 -> 2 x 2880).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bench.suites.moe import _routing_sizes, _torch_grouped_mm
from bench.timing import ROWS, print_table, record, rel_err, time_jax
from tessera.lower.kernels import grouped_matmul as gm
from bench.experiments import grouped_swiglu as gsw

M, G, D = 32768, 128, 2880


def _data(m, k, n, sizes, seed=0, scale=1.0):
    ks = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(ks[1], (len(sizes), k, n), jnp.float32) * scale).astype(jnp.bfloat16)
    ct = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), ct


def check() -> None:
    """Forward and both gradients vs ragged_dot in fp32; fused SwiGLU (+ grads) vs its reference."""
    cases = [(1024, 256, 512, [100, 0, 300, 1, 0, 623]), (4096, 2880, 5760, _routing_sizes(4096, 16, 3, 4)),
             (640, 128, 192, [0, 0, 0, 600]), (100, 64, 64, [30, 0, 50])]
    for m, k, n, sizes in cases:
        lhs, rhs, gs, ct = _data(m, k, n, sizes, seed=m)
        f32 = lambda x: x.astype(jnp.float32)

        def grads(fn, a, b):
            out, vjp = jax.vjp(lambda a, b: fn(a, b, gs), a, b)
            return (out, *vjp(ct.astype(out.dtype)))
        got = jax.jit(lambda a, b: grads(gm.grouped_matmul, a, b))(lhs, rhs)
        want = jax.jit(lambda a, b: grads(gm.grouped_matmul_reference, a, b))(f32(lhs), f32(rhs))
        errs = [rel_err(g, w) for g, w in zip(got, want)]
        print(f"  check gmm M{m} K{k} N{n}: out {errs[0]:.1e} dlhs {errs[1]:.1e} drhs {errs[2]:.1e}", flush=True)
    for m, d, f, sizes in [(4096, 2880, 2880, _routing_sizes(4096, 16, 5, 4)), (200, 128, 64, [50, 0, 100, 0, 30])]:
        x, gate, gs, _ = _data(m, d, f, sizes, seed=1, scale=0.05)
        up = (jax.random.normal(jax.random.key(9), gate.shape) * 0.05).astype(gate.dtype)
        gb, ub = (jax.random.normal(jax.random.key(s), (len(sizes), f)) for s in (10, 11))
        ct = jax.random.normal(jax.random.key(12), (m, f), jnp.float32)

        def grads(fn, x, gate, up, gb, ub):
            out, vjp = jax.vjp(lambda *a: fn(a[0], a[1], a[2], gs, gate_bias=a[3], up_bias=a[4]), x, gate, up, gb, ub)
            return (out, *vjp(ct.astype(out.dtype)))
        fused = jax.jit(lambda *a: gsw.grouped_swiglu(a[0], a[1], a[2], gs, gate_bias=a[3], up_bias=a[4]))
        ref = gsw.grouped_swiglu_reference(x, gate, up, gs, gate_bias=gb, up_bias=ub)
        print(f"  check fused M{m} D{d} F{f}: h {rel_err(fused(x, gate, up, gb, ub), ref):.1e}", flush=True)
        got = jax.jit(lambda *a: grads(gsw.grouped_swiglu, *a))(x, gate, up, gb, ub)
        want = jax.jit(lambda *a: grads(gsw.grouped_swiglu_reference, *a))(x, gate, up, gb, ub)
        names = ["h(train)", "dx", "dgate", "dup", "dgb", "dub"]
        print("  check fused grads: " + " ".join(f"{n} {rel_err(g, w):.1e}" for n, g, w in zip(names, got, want)))


def _big(n=5760, empty=0):
    sizes = _routing_sizes(M, G, empty=empty)
    lhs, rhs, gs, ct = _data(M, D, n, sizes, seed=1, scale=0.05)
    return sizes, lhs, rhs, gs, ct


def fwd() -> None:
    """Forward tile variants, 2880 -> 5760, against torch._grouped_mm."""
    sizes, lhs, rhs, gs, _ = _big()
    flops, case = 2.0 * M * D * 5760, f"fwd M{M} G{G} 2880->5760"
    base = gm.GroupedMatmulConfig()
    variants = [dict(), dict(band=16), dict(skip_idle=False), dict(stages=3), dict(block_n=128),
                dict(block_n=128, stages=5), dict(block_m=256, block_n=128, stages=3), dict(band=4)]
    for v in variants:
        cfg = dataclasses.replace(base, **v)
        record(case, f"tessera {v or 'default'}", lambda: time_jax(lambda a, b: gm.grouped_matmul(a, b, gs, config=cfg),
                                                                   lhs, rhs), flops)
    record(case, "torch._grouped_mm", lambda: _torch_grouped_mm(lhs, rhs, sizes, False), flops)


def bwd() -> None:
    """d lhs and d rhs variants separately, then the whole forward + backward with the defaults."""
    sizes, lhs, rhs, gs, ct = _big()
    flops = 2.0 * M * D * 5760
    for v in [dict(block_n=192), dict(block_n=192, stages=3), dict(block_n=64, stages=6)]:
        cfg = dataclasses.replace(gm.GroupedMatmulConfig(), **v)
        record("dlhs 5760->2880", f"tessera {v}", lambda: time_jax(
            lambda c, b: gm.grouped_call(c, [b], gs, cfg, transpose_rhs=True), ct, rhs), flops)
    for v in [dict(), dict(drhs_groups=8), dict(drhs_groups=16), dict(drhs_groups=2), dict(stages=3),
              dict(block_n=128), dict(block_n=128, stages=5)]:
        cfg = dataclasses.replace(gm.GroupedMatmulConfig(), **v)
        record("drhs 2880x5760", f"tessera {v or 'default'}", lambda: time_jax(
            lambda a, c: gm.grouped_drhs(a, c, gs, G, cfg), lhs, ct), flops)

    def fb(f):
        def run(a, b, c):
            out, vjp = jax.vjp(lambda a, b: f(a, b, gs), a, b)
            return out, vjp(c)
        return run
    case = f"fwd+bwd M{M} G{G} 2880->5760"
    record(case, "tessera", lambda: time_jax(fb(gm.grouped_matmul), lhs, rhs, ct), 3 * flops)
    record(case, "torch._grouped_mm", lambda: _torch_grouped_mm(lhs, rhs, sizes, True), 3 * flops)


def fused(variants=(dict(), dict(stages=6), dict(block_m=256, stages=3))) -> None:
    """Fused gate/up + clamped SwiGLU vs the unfused pair of grouped GEMMs + XLA activation."""
    sizes, x, gate, gs, _ = _big(2880)
    up = (jax.random.normal(jax.random.key(7), gate.shape, jnp.float32) * 0.05).astype(gate.dtype)
    gb, ub = (jax.random.normal(jax.random.key(s), (G, 2880)) for s in (1, 2))
    flops, case = 2.0 * M * D * 5760, f"moe gate/up+swiglu M{M} G{G} 2880->2x2880"
    for v in variants:
        cfg = gsw.config_for(2880, **v)
        record(case, f"tessera fused {v or ''}".strip(), lambda: time_jax(
            lambda x, a, b: gsw.grouped_swiglu(x, a, b, gs, gate_bias=gb, up_bias=ub, config=cfg), x, gate, up), flops)
    rows = jnp.repeat(jnp.arange(G), gs, total_repeat_length=M)

    def unfused(x, a, b):  # as reference/moe.py computes it, on the grouped GEMM kernel
        g = gm.grouped_matmul(x, a, gs).astype(jnp.float32) + gb[rows]
        u = gm.grouped_matmul(x, b, gs).astype(jnp.float32) + ub[rows]
        return gsw.clamped_swiglu(g.astype(x.dtype), u.astype(x.dtype), alpha=1.702, limit=7.0)
    record(case, "tessera unfused (2 gmm + XLA act)", lambda: time_jax(unfused, x, gate, up), flops)
    cat = jnp.concatenate([gate, up], axis=2)
    record(case, "torch._grouped_mm [gate|up], no act", lambda: _torch_grouped_mm(x, cat, sizes, False), flops)


def fused_rows() -> None:
    """The fused rows of bench.kernels' moe group (default tiles only)."""
    fused(variants=(dict(),))


def main() -> None:
    """Run the selected parts, print one table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="check,fwd,bwd,fused")
    parts = {"check": check, "fwd": fwd, "bwd": bwd, "fused": fused}
    for name in ap.parse_args().part.split(","):
        try:
            parts[name]()
        except Exception as e:  # one failing part must not hide the others
            print(f"  part {name} failed: {type(e).__name__}: {str(e)[:600]}", flush=True)
    if ROWS:
        print_table()


if __name__ == "__main__":
    main()
