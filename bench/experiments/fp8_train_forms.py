"""One fp8 linear's forward and backward as a train step runs it (x [m, k] bf16 activations after a producer, w [k, n]
fp32 master weight, cotangent g): bf16, per_tensor and delayed scaling, and delayed scaling without its fallback to
the current amax for an empty history ("history only": the cast then need not wait on x's own reduction). Since
session 33 the built form ("fp8 delayed") falls back for the gradient only; "select" is the form built before.

    python -m bench.experiments.fp8_train_forms

First measured (session 32, one H100, jax 0.11.2; fwd+bwd ms at m = 16,384 tokens) with the history a constant of
the program, which was wrong: XLA folded the select on the history's max and dropped the amaxes the history records
(their cotangent was discarded), so both delayed forms ran as "scale known, no reduction":

| shape (k -> n) | bf16 | fp8 per_tensor | fp8 delayed (select) | delayed, history only |
|---|---|---|---|---|
| 2048 -> 8192 (MLP up) | 1.690 | 1.444 | 1.233 | 1.217 |
| 8192 -> 2048 (MLP down) | 1.822 | 1.799 | 1.414 | 1.416 |
| 2048 -> 2048 (q) | 0.474 | 0.552 | 0.425 | 0.424 |

What it does show: a product whose operands' scales need no reduction of the operand first ran 1.17-1.30x faster
than per_tensor's. In the Llama-1B step (`bench.e2e`, same device call) delayed(16), whose select on a runtime
history keeps that reduction ahead of every cast, took 262.5 ms against bf16's 273.9 (1.04x), compile 194 s (bf16: 22
s). The history is now an input and its cotangent an output (`step`): to be measured again. A fourth form put every
operand contiguous along K ("TN", cuBLASLt's fp8 layout, each transposed behind an optimization barrier): bitwise
the same gradients and within 1 % of per_tensor's time at all three shapes (XLA lays the operands out itself); not
kept.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from bench.experiments.lowering_variants import every_operand_falls_back, history_only, patched
from bench.timing import time_jax
from tessera.lower.reference import fp8

SHAPES = [("llama-1b mlp up b8x2048", 16384, 2048, 8192), ("llama-1b mlp down b8x2048", 16384, 8192, 2048),
          ("llama-1b q b8x2048", 16384, 2048, 2048)]


def _patched(fn, **patches):
    """fn with reference/fp8.py's functions replaced while it traces (the forward and its VJP both: `step` traces
    the whole forward-and-backward inside fn's call)."""
    def traced(*args):
        with patched([(fp8, k, v) for k, v in patches.items()]):
            return fn(*args)

    traced.patches = patches
    return traced


def step(fn):
    """The jitted forward and backward of fn(x, w, history) after a producer (SwiGLU's silu, which a cast that needs no
    reduction can fuse into), at cotangent g: (dx, dw, d history). The history is an input, as in a train step (a
    constant one let XLA fold the scale's select and drop the amaxes the history records: session 32's first
    measurement of these forms was wrong for that reason), and its cotangent, the step's amaxes, is an output."""
    def grads(x, w, history, g):
        return jax.vjp(lambda x, w, h: fn(jax.nn.silu(x), w, h), x, w, history)[1](g)

    return jax.jit(_patched(grads, **getattr(fn, "patches", {})))


def _delayed(quantize_delayed=None):
    """The built delayed product, or with `quantize_delayed` patched in (lowering_variants)."""
    def product(x, w, history):
        return fp8.einsum("mk,kn->mn", x, w, accum=jnp.float32, preferred_element_type=jnp.bfloat16,
                          scaling="delayed(16)", history=history)

    return product if quantize_delayed is None else _patched(product, quantize_delayed=quantize_delayed)


def per_tensor(x, w, history):
    del history
    return fp8.einsum("mk,kn->mn", x, w, accum=jnp.float32, preferred_element_type=jnp.bfloat16)


def forms():
    return {
        "bf16": lambda x, w, h: jnp.dot(x, w.astype(jnp.bfloat16), preferred_element_type=jnp.bfloat16),
        "fp8 per_tensor": per_tensor,
        "fp8 delayed (select)": _delayed(every_operand_falls_back),
        "fp8 delayed": _delayed(),
        "fp8 delayed, history only": _delayed(history_only),
    }


def main() -> None:
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    for name, m, k, n in SHAPES:
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * k ** -0.5
        g = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16) * 1e-3
        work = 3 * 2.0 * m * k * n
        history = jnp.zeros((3, 16), jnp.float32).at[:, 1].set(jnp.asarray([5.0, 0.15, 6e-3]))  # about the inputs'
        got = {}
        for label, fn in forms().items():
            run = step(fn)
            got[label] = run(x, w, history, g)[:2]
            ms = time_jax(run, x, w, history, g)
            hlo = run.lower(x, w, history, g).compile().as_text()
            kinds = sorted(set(t for pair in re.findall(r'custom_call_target="([^"]+)"|kind=k(\w+)', hlo)
                               for t in pair if t))
            gemms = len(re.findall(r"__cublas\$lt\$matmul|__cublas\$gemm|gemm_fusion", hlo))
            print(f"  {name:<26} {label:<22} {ms:7.3f} ms {work / ms / 1e9:7.1f} TFLOP/s  gemm calls {gemms} "
                  f"{kinds}", flush=True)
        ref = got["fp8 per_tensor"]
        for label, (dx, dw) in got.items():
            err = [float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
                   for a, b in ((dx, ref[0]), (dw, ref[1]))]
            print(f"  {name:<26} {label:<22} vs per_tensor: dx {err[0]:.1e} dw {err[1]:.1e}", flush=True)


if __name__ == "__main__":
    main()
