"""XLA's fp8 GEMM written several ways, to find the form that runs at cuBLAS's fp8 rate on Hopper.

`bench.kernels --only fp8` measured XLA's fp8 `dot` (pre-quantised operands, fp32 result) at about half of
`torch._scaled_mm` on the Llama-1B training shapes. This times, per shape: fp32 vs bf16 results, the weight
stored [k, n] (n-major) vs [n, k] (k-major, the layout cuBLASLt's fp8 kernels take), and the scale folded
into the product; run it under `XLA_FLAGS=--xla_gpu_enable_triton_gemm=false` too, to see whether XLA's
Triton GEMM or cuBLAS ran it (the fusion kinds in the compiled HLO are printed).

    python -m bench.experiments.fp8_gemm_variants
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from bench.timing import time_jax

E4M3 = jnp.float8_e4m3fn
SHAPES = [("llama-1b mlp up b8x2048", 16384, 2048, 8192), ("llama-1b mlp down b8x2048", 16384, 8192, 2048),
          ("8192^3", 8192, 8192, 8192)]
KN = (((1,), (0,)), ((), ()))  # x [m, k] . w [k, n]
NK = (((1,), (1,)), ((), ()))  # x [m, k] . w [n, k]


def variants(s):
    return {
        "bf16 dot [k,n] -> bf16": (lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16), "bf16kn"),
        "fp8 [k,n] -> f32, /s, bf16": (lambda x, w: (jax.lax.dot_general(x, w, KN, preferred_element_type=jnp.float32)
                                                     / s).astype(jnp.bfloat16), "kn"),
        "fp8 [k,n] -> bf16, /s": (lambda x, w: jax.lax.dot_general(x, w, KN, preferred_element_type=jnp.bfloat16)
                                  / s.astype(jnp.bfloat16), "kn"),
        "fp8 [n,k] -> f32, /s, bf16": (lambda x, w: (jax.lax.dot_general(x, w, NK, preferred_element_type=jnp.float32)
                                                     / s).astype(jnp.bfloat16), "nk"),
        "fp8 [n,k] -> bf16, /s": (lambda x, w: jax.lax.dot_general(x, w, NK, preferred_element_type=jnp.bfloat16)
                                  / s.astype(jnp.bfloat16), "nk"),
        "fp8 [n,k] widened*s (XLA's scaled pattern)": (
            lambda x, w: jax.lax.dot_general(x.astype(jnp.bfloat16) * s.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                             NK, preferred_element_type=jnp.bfloat16), "nk"),
        # bf16 operands quantised inside the program, as a train step does (the weight held [k, n]): does XLA's
        # layout assignment give the weight's quantisation a k-major output by itself, or must the product ask
        # for it by quantising w.T (the transpose fused into the cast that reads w anyway)?
        "bf16 in, quantise, [k,n] -> bf16 (Tessera's)": (_quantised(transposed=False), "bf16kn"),
        "bf16 in, quantise w.T, [n,k] -> bf16": (_quantised(transposed=True), "bf16kn"),
    }


def _quantised(transposed: bool):
    from tessera.lower.reference import fp8

    def product(x, w):
        (xq, sx), (wq, sw) = fp8.quantize(x, fp8.E4M3), fp8.quantize(w.T if transposed else w, fp8.E4M3)
        y = jax.lax.dot_general(xq, wq, NK if transposed else KN, preferred_element_type=jnp.bfloat16)
        return y / (sx * sw).astype(jnp.bfloat16)

    return product


def main() -> None:
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    for name, m, k, n in SHAPES:
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        xq, wq = x.astype(E4M3), (w * 16).astype(E4M3)
        s = jnp.asarray(16.0, jnp.float32)
        ops = {"bf16kn": (x, w), "kn": (xq, wq), "nk": (xq, wq.T.copy())}
        work = 2.0 * m * k * n
        for label, (fn, form) in variants(s).items():
            a, b = ops[form]
            ms = time_jax(fn, a, b)
            hlo = jax.jit(fn).lower(a, b).compile().as_text()
            kinds = sorted(set(t for pair in re.findall(r'custom_call_target="([^"]+)"|kind=k(\w+)', hlo)
                               for t in pair if t))
            print(f"  {name:<28} {label:<42} {ms:7.3f} ms {work / ms / 1e9:8.1f} TFLOP/s  {kinds}", flush=True)


if __name__ == "__main__":
    main()
