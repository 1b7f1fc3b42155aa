"""Grouped GEMM (the MoE experts) against torch._grouped_mm, lax.ragged_dot and a padded batched einsum
(`--only moe`), and the dense GEMM that gives the peers' matrix-unit ceiling (`--only dense`).
TFLOP/s count the real rows: 2*M*K*N forward, 3x that forward + backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import record, rel_err, time_jax, time_torch


def _routing_sizes(m: int, g: int, seed: int = 0, empty: int = 0) -> np.ndarray:
    """Group sizes of m rows routed at random over g experts (the last `empty` experts get none)."""
    ids = np.random.default_rng(seed).integers(0, g - empty, m)
    return np.bincount(ids, minlength=g).astype(np.int32)


def _torch_grouped_mm(lhs, rhs, sizes, backward: bool):
    """torch._grouped_mm on the same data (rhs as [G, N, K] transposed: its fast layout)."""
    import torch
    a = torch.from_dlpack(lhs)
    b = torch.from_dlpack(rhs).transpose(-2, -1).contiguous().transpose(-2, -1)
    offs = torch.from_dlpack(jnp.cumsum(jnp.asarray(sizes)).astype(jnp.int32))
    if not backward:
        return time_torch(lambda: torch._grouped_mm(a, b, offs=offs))
    a.requires_grad_(True)
    b.requires_grad_(True)
    g = torch.randn_like(torch._grouped_mm(a, b, offs=offs))
    # forward + backward, as the Tessera row (jax.vjp then the pullback) times it
    return time_torch(lambda: torch.autograd.grad(torch._grouped_mm(a, b, offs=offs), (a, b), g))


def run_moe(check: bool = False) -> None:
    """GPT-OSS expert GEMM: 32768 rows, 128 experts, 2880 -> 5760 (and 2880 -> 2880), fwd / bwd."""
    from tessera.lower.kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
    for m, g, k, n, empty in [(32768, 128, 2880, 5760, 0), (32768, 128, 2880, 2880, 16)]:
        sizes = _routing_sizes(m, g, empty=empty)
        ks = jax.random.split(jax.random.key(1), 3)
        lhs = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
        rhs = jax.random.normal(ks[1], (g, k, n), jnp.bfloat16) * 0.05
        ct = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
        gs = jnp.asarray(sizes)
        flops = 2.0 * m * k * n
        tag = f"M{m} G{g} {k}->{n}" + (f" ({empty} empty)" if empty else "")
        if check:
            got = grouped_matmul(lhs[:4096], rhs, jnp.asarray(_routing_sizes(4096, g, 1)))
            want = grouped_matmul_reference(lhs[:4096], rhs, jnp.asarray(_routing_sizes(4096, g, 1)))
            err = rel_err(got, want)
            print(f"  check {tag}: rel err {err:.2e}")
        cap = int(-(-sizes.max() // 128) * 128)
        rows = np.concatenate([np.arange(s) + o for s, o in zip(sizes, np.cumsum(sizes) - sizes)])
        slot = np.concatenate([np.arange(s) + i * cap for i, s in enumerate(sizes)])

        def padded(lhs, rhs):  # scatter into [G, cap, K], batched einsum, gather back
            buf = jnp.zeros((g * cap, k), lhs.dtype).at[slot].set(lhs[rows]).reshape(g, cap, k)
            out = jnp.einsum("gck,gkn->gcn", buf, rhs, preferred_element_type=jnp.float32)
            return out.reshape(g * cap, n)[slot].astype(lhs.dtype)

        ours = lambda a, b: grouped_matmul(a, b, gs)
        ragged = lambda a, b: grouped_matmul_reference(a, b, gs)
        for direction, mult in (("fwd", 1.0), ("fwd+bwd", 3.0)):
            case = f"moe {direction} {tag}"
            if direction == "fwd":
                wrap, args = (lambda f: f), (lhs, rhs)
            else:
                def wrap(f):
                    def fb(a, b, c):
                        out, vjp = jax.vjp(f, a, b)
                        return out, vjp(c)
                    return fb
                args = (lhs, rhs, ct)
            record(case, "tessera (mosaic gpu)", lambda: time_jax(wrap(ours), *args), flops * mult)
            record(case, "torch._grouped_mm", lambda: _torch_grouped_mm(lhs, rhs, sizes, direction != "fwd"),
                   flops * mult)
            record(case, "padded batched einsum", lambda: time_jax(wrap(padded), *args), flops * mult)
            if direction == "fwd":
                record(case, "lax.ragged_dot (XLA)", lambda: time_jax(wrap(ragged), *args, iters=3),
                       flops * mult)
    from bench.moe_variants import fused_rows
    fused_rows()  # gate/up GEMM + clamped SwiGLU, fused vs unfused


def run_dense(check: bool = False) -> None:
    """Dense GEMM 8192^3 bf16: the peers' matrix-unit ceiling on this GPU (no Tessera kernel)."""
    import torch
    a = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    record("dense GEMM 8192^3", "XLA (jnp.dot)", lambda: time_jax(jnp.dot, a, a), 2.0 * 8192**3)
    ta = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    record("dense GEMM 8192^3", "torch.mm", lambda: time_torch(lambda: ta @ ta), 2.0 * 8192**3)
