"""Each of an fp8 linear's three products alone (forward, input gradient, weight gradient), as Tessera's
per_tensor recipe forms them (reference/fp8.py: e4m3 x e4m3 forward at DEFAULT precision, e5m2 gradient products at
HIGHEST), against the same products in bf16 and `torch._scaled_mm` on K-contiguous operands in the same process.

Why (issue 35, the Llama-1B fp8 step at 1.06x bf16 against 1.3x): fp8_train_forms timed a linear's forward and
backward together at 1.0-1.4x bf16 even with the scales known ahead; this splits that into its products, to see which
of them XLA runs below cuBLASLt's fp8 rate (the weight gradient contracts over the 16,384 tokens, so both of its
operands are token-major and must be transposed for cuBLASLt's K-contiguous fp8 layout) and what the precision of the
gradient products costs.

    python -m bench.experiments.fp8_products [--shapes up,down,q]

Operands are quantised outside the timed call (the GEMM alone). The HLO column lists the compiled program's custom
calls and fusion kinds (transposes show as `kTranspose`/`kLoop` copies beside the `__cublas$lt$matmul$f8`).
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp

from bench.timing import time_jax, time_torch

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
HIGHEST, DEFAULT = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT
SHAPES = {"up": (16384, 2048, 8192), "down": (16384, 8192, 2048), "q": (16384, 2048, 2048)}  # m tokens, k in, n out

# the three products of y[m, n] = x[m, k] . w[k, n], each (einsum, its operands' names, output dtype)
PRODUCTS = {"fwd": ("mk,kn->mn", ("x", "w"), jnp.bfloat16),
            "dgrad": ("mn,kn->mk", ("g", "w"), jnp.bfloat16),
            "wgrad": ("mk,mn->kn", ("x", "g"), jnp.float32)}


def _kinds(fn, *args) -> str:
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    found = re.findall(r'custom_call_target="([^"]+)"|kind=k(\w+)', hlo)
    names = [a or b for a, b in found]
    return ", ".join(f"{n} x{names.count(n)}" for n in sorted(set(names)))


def _torch_row(which: str, m: int, k: int, n: int) -> float:
    """torch._scaled_mm on the product's operands laid out as cuBLASLt's fp8 GEMM takes them (A row-major [rows, K],
    B column-major [K, cols]), fast accumulation in the forward only (torchao's Float8Linear default)."""
    import torch

    rows, cols, kk = {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (k, n, m)}[which]
    a_t, b_t = {"fwd": (torch.float8_e4m3fn, torch.float8_e4m3fn), "dgrad": (torch.float8_e5m2, torch.float8_e4m3fn),
                "wgrad": (torch.float8_e4m3fn, torch.float8_e5m2)}[which]
    a = torch.randn(rows, kk, device="cuda").to(a_t)
    b = torch.randn(cols, kk, device="cuda").to(b_t).t()
    one = torch.ones((), device="cuda")
    out = torch.bfloat16 if which != "wgrad" else torch.float32
    return time_torch(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=out,
                                               use_fast_accum=which == "fwd"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; TFLOP/s of 2 m k n\n")
    print("| shape | product | bf16 | fp8 as built | fp8 DEFAULT | fp8 K-major operands | torch._scaled_mm | fp8 HLO |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        m, k, n = SHAPES[name]
        keys = jax.random.split(jax.random.key(0), 3)
        bf = {"x": jax.random.normal(keys[0], (m, k), jnp.bfloat16),
              "w": (jax.random.normal(keys[1], (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16),
              "g": (jax.random.normal(keys[2], (m, n), jnp.float32) * 1e-3).astype(jnp.bfloat16)}
        q = {"x": (bf["x"] * 64).astype(E4M3), "w": (bf["w"] * 256).astype(E4M3), "g": (bf["g"] * 2**14).astype(E5M2)}
        work = 2.0 * m * k * n
        for which, (spec, (a, b), out) in PRODUCTS.items():
            built = HIGHEST if which != "fwd" else None

            def fp8(a_, b_, prec=built, spec=spec, out=out):
                return jnp.einsum(spec, a_, b_, preferred_element_type=out, precision=prec)

            def bf16(a_, b_, spec=spec, out=out):
                return jnp.einsum(spec, a_, b_, preferred_element_type=out)

            # K-contiguous operands: each one's contracted dim last, transposed once outside the timed call
            ins, res = spec.split("->")
            sa, sb = ins.split(",")
            kdim = (set(sa) & set(sb)).pop()
            last = lambda s: "".join(c for c in s if c != kdim) + kdim  # noqa: E731
            ta, tb = jnp.einsum(f"{sa}->{last(sa)}", q[a]), jnp.einsum(f"{sb}->{last(sb)}", q[b])

            def kmajor(a_, b_, spec=f"{last(sa)},{last(sb)}->{res}", prec=built, out=out):
                return jnp.einsum(spec, a_, b_, preferred_element_type=out, precision=prec)

            cells = [time_jax(bf16, bf[a], bf[b]), time_jax(fp8, q[a], q[b]),
                     time_jax(lambda a_, b_: fp8(a_, b_, DEFAULT), q[a], q[b]), time_jax(kmajor, ta, tb)]
            try:
                cells.append(_torch_row(which, m, k, n))
            except Exception as e:  # noqa: BLE001 (no torch on the machine: the row without its peer)
                print(f"  torch: {type(e).__name__}: {e}")
                cells.append(float("nan"))
            row = " | ".join(f"{ms:.3f} ms ({work / ms / 1e9:,.0f})" for ms in cells)
            print(f"| {name} {m}x{k}->{n} | {which} | {row} | {_kinds(fp8, q[a], q[b])} |", flush=True)


if __name__ == "__main__":
    main()
