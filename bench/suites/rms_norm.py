"""Fused RMSNorm (+ residual) against XLA's fusion, GPT-OSS width, GB/s of the minimal traffic
(`--only rmsnorm`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.timing import record, rel_err, time_rotating


def run_rms_norm(check: bool = False) -> None:
    """x + r -> RMSNorm * scale (GPT-OSS width 2880), fused kernel vs XLA's fusion, GB/s of the minimal traffic.

    fwd (+residual) moves 4 tensors (x, r in; y, h out), fwd+bwd 8 (+ h, dy, dh in; dh out; random
    cotangents), plain RMSNorm fwd 2 (what the `rmsnorm` op lowers to).
    """
    from bench.experiments.rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm
    from tessera.lower.reference.norms import rms_norm as rms_norm_reference
    d = 2880
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.key(5), (d,), jnp.float32)
    for rows in (4096, 32768):
        xs = [jax.random.normal(jax.random.key(i), (rows, d), jnp.bfloat16) for i in range(4)]
        r, cy, ch = (jax.random.normal(jax.random.key(9 + i), (rows, d), jnp.bfloat16) for i in range(3))
        tensor = rows * d * 2
        if check:
            got, want = add_rms_norm(xs[0], r, scale, eps=1e-5)[0], add_rms_norm_reference(xs[0], r, scale, eps=1e-5)[0]
            print(f"  check rmsnorm {rows}x{d}: rel err {rel_err(got, want):.2e}")
        plain = [("tessera rmsnorm (pallas triton)", rms_norm),
                 ("XLA fusion (jnp)", lambda x, s, eps: rms_norm_reference(x, scale=s, eps=eps))]
        for name, fn in plain:
            record(f"rmsnorm fwd {rows}x{d}", name,
                   lambda: time_rotating(lambda s, x, fn=fn: fn(x, s, eps=1e-5), (scale,), xs), 2 * tensor, "GB/s")
        for name, fn in [(plain[0][0], add_rms_norm), (plain[1][0], add_rms_norm_reference)]:
            fwd = lambda r, s, x, fn=fn: fn(x, r, s, eps=1e-5)
            record(f"rmsnorm+residual fwd {rows}x{d}", name, lambda: time_rotating(fwd, (r, scale), xs),
                   4 * tensor, "GB/s")

            def fwd_bwd(r, s, cy, ch, x, fn=fn):
                out, vjp = jax.vjp(lambda x, r, s: fn(x, r, s, eps=1e-5), x, r, s)
                return vjp((cy, ch))
            record(f"rmsnorm+residual fwd+bwd {rows}x{d}", name,
                   lambda: time_rotating(fwd_bwd, (r, scale, cy, ch), xs), 8 * tensor, "GB/s")
