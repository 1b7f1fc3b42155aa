"""fp8 GEMMs (`--only fp8`): the product Tessera's `fp8_e4m3 @scale(per_tensor)` policy runs, against XLA's
bf16 GEMM, XLA's fp8 `dot` on pre-quantised operands, and `torch._scaled_mm`, at 8192^3 and the Llama-3.2-1B /
GPT-OSS training shapes (TFLOP/s of 2 m n k).

Tessera's first row includes the quantisation of both operands on every call (amax, scale, cast: the
current-scaling recipe); its second holds the weight quantised beforehand, in the layout the GEMM reads, as a
train step now does (tessera/lower/fp8_held.py), so only the activation is quantised per call; "XLA fp8 dot" is the GEMM alone on operands quantised once (the weight K-contiguous, a bf16
result), the ceiling a quantisation fused into the previous op would approach. The three products of a training
step one by one (forward, input and weight gradients): bench/experiments/fp8_products.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.timing import record, rel_err, time_jax, time_torch

# (name, m, k, n): m rows (tokens) of k features times [k, n]
SHAPES = [("8192^3", 8192, 8192, 8192),
          ("llama-1b mlp up b8x2048", 16384, 2048, 8192),
          ("llama-1b mlp down b8x2048", 16384, 8192, 2048),
          ("gpt-oss qkv b2x4096", 8192, 2880, 5120)]


def run_fp8(check: bool = False, shapes=None) -> None:
    """Each shape's rows; `check` prints Tessera's product's error against the bf16 GEMM."""
    from tessera.lower.reference import fp8

    for name, m, k, n in shapes or SHAPES:
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        work = 2.0 * m * k * n
        case = f"fp8 gemm {name}"
        tessera = jax.jit(lambda x, w: fp8.einsum("mk,kn->mn", x, w, accum=jnp.float32,
                                                  preferred_element_type=jnp.bfloat16))
        # as a train step's forward runs it (tessera/lower/fp8_held.py): the weight quantised once before the
        # layers' loop, in the layout the GEMM reads (`hold`'s lead); the activation's amax and cast every call
        held = jax.jit(lambda x, w, h: fp8.einsum("mk,kn->mn", x, w, accum=jnp.float32,
                                                  preferred_element_type=jnp.bfloat16, held=h))
        bf16 = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16))
        (xq, sx), (wq, sw) = fp8.quantize(x, fp8.E4M3), fp8.quantize(w, fp8.E4M3)
        # XLA's fastest form of the product (bench/experiments/fp8_gemm_variants.py): the weight K-contiguous ([n, k],
        # as cuBLASLt's fp8 GEMM and the torch row take it), the bf16 result divided by the scale (folded into the call)
        wq_nk = wq.T.copy()
        xla_fp8 = jax.jit(lambda a, b, s: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                              preferred_element_type=jnp.bfloat16)
                          / s.astype(jnp.bfloat16))
        if check:
            print(f"  check {case}: fp8 vs bf16 rel err {rel_err(tessera(x, w), bf16(x, w)):.2e}")
        record(case, "tessera fp8 (per-tensor current scaling)", lambda: time_jax(tessera, x, w), work)
        w_held = jax.block_until_ready(fp8.hold(w, jnp.bfloat16, lead=1))
        if check:
            print(f"  check {case}: held weight vs quantised in the product: "
                  f"{'same bits' if bool((held(x, w, w_held) == tessera(x, w)).all()) else 'DIFFERENT'}")
        record(case, "tessera fp8 (weight held, K-contiguous)", lambda: time_jax(held, x, w, w_held), work)
        record(case, "XLA fp8 dot (pre-quantised)", lambda: time_jax(xla_fp8, xq, wq_nk, sx * sw), work)
        record(case, "XLA bf16 dot", lambda: time_jax(bf16, x, w), work)
        record(case, "torch._scaled_mm", lambda: _torch_scaled_mm(m, k, n), work)


def _torch_scaled_mm(m: int, k: int, n: int) -> float:
    import torch

    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    return time_torch(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
