"""The MoE router product at decode sizes, written four ways, inside a decode-like loop on the GPU.

`tessera profile specs/gpt_oss_20b.yaml` showed the router (x [1, 2880] @ router [2880, 32], bf16 in, fp32
out) as an XLA reduction fusion of 26 us per layer and token on an H200: 11 % of batch-1 decode. XLA turns a
matrix-vector product into multiply + reduce, fuses the norm that produces x into it, and over [D, E] that
reduce runs down the columns. This times each formulation after an RMSNorm in a scan over tokens with 24
layers' routers (as generation holds them: one array per layer), checks each against a float64 product, and
prints the fusion kinds each becomes. First GPU run (H200, jax 0.11.2), without the norm in front: every
formulation was a cuBLAS call of 4.3 us (batch 1) — the 26 us case needs the fused producer. Second run
(sixteenth session), with the norm: every formulation 5.5-6 us per layer-token, two rows 8.9 us. Inside
GPT-OSS-20B's generate the product is a column reduce of its own (the norm is not fused into it), 26.5 us
in `tessera profile` and 5.8 us as two rows, but `tessera run` (CUDA graphs) ran no faster with two rows.

    python -m bench.decode_router [--tokens 64] [--layers 24] [--batch 1]
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

F32 = dict(preferred_element_type=jnp.float32)
VARIANTS = {
    "einsum [D,E] (before)": lambda x, w: jnp.einsum("td,de->te", x, w, **F32),
    "einsum over w.T": lambda x, w: jnp.einsum("td,ed->te", x, w.T, **F32),
    "rows padded to 2": lambda x, w: jnp.einsum("td,de->te", jnp.concatenate([x, x[:1]]) if x.shape[0] == 1 else x,
                                                w, **F32)[:x.shape[0]],
    "sum over w.T rows": lambda x, w: jnp.sum(x[:, None, :].astype(jnp.float32) * w.T[None].astype(jnp.float32), -1),
    "barrier on x": lambda x, w: jnp.einsum("td,de->te", jax.lax.optimization_barrier(x), w, **F32),
}


def rmsnorm(x):
    """The router's producer in the model (its input is the MLP norm's output): XLA fuses it into the product."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-5)).astype(x.dtype)


def decode_loop(fn, layers: list, x0, tokens: int):
    def step(x, _):
        for w in layers:
            logits = fn(rmsnorm(x), w)
            x = x + (jnp.max(logits, axis=-1, keepdims=True) * 1e-3).astype(x.dtype)
        return x, None

    return jax.lax.scan(step, x0, None, length=tokens)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dim", type=int, default=2880)
    ap.add_argument("--experts", type=int, default=32)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    layers = [jnp.asarray(rng.normal(0, 0.02, (args.dim, args.experts)), jnp.bfloat16) for _ in range(args.layers)]
    x0 = jnp.asarray(rng.normal(0, 1, (args.batch, args.dim)), jnp.bfloat16)
    want = np.asarray(x0, np.float64) @ np.asarray(layers[0], np.float64)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: batch {args.batch}, {args.layers} layers, "
          f"{args.tokens} tokens")
    for name, fn in VARIANTS.items():
        err = float(np.max(np.abs(np.asarray(jax.jit(fn)(x0, layers[0]), np.float64) - want)))
        run = jax.jit(lambda ls, x: decode_loop(fn, ls, x, args.tokens))
        compiled = run.lower(layers, x0).compile()
        kinds = sorted(set(re.findall(r"kind=k(\w+)|custom_call_target=\"([^\"]+)\"", compiled.as_text())))
        jax.block_until_ready(compiled(layers, x0))
        times = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(compiled(layers, x0))
            times.append(time.perf_counter() - t)
        per = min(times) / (args.tokens * args.layers)
        print(f"{name:<24} {per * 1e6:8.2f} us per layer-token   max |err| {err:.2e}   "
              f"{[k for pair in kinds for k in pair if k]}")


if __name__ == "__main__":
    main()
