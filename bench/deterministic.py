"""Attention backward: is each implementation bitwise repeatable, and what does repeatability cost the peers?

    python -m bench.deterministic [--force]

Tessera's backward is deterministic by construction (dK/dV and dQ come from two kernels that
each own their outputs: no atomics). cuDNN's and PyTorch's default backward kernels add dQ
partials with atomics, so two runs on the same inputs can differ in the last bits. `--force`
asks the peers for their deterministic algorithms (XLA's `--xla_gpu_deterministic_ops`, which
cuDNN honours, and `torch.use_deterministic_algorithms(True)`) and times them against Tessera.
Each row: the backward alone (forward run beforehand), then whether two runs gave identical bits.
"""

from __future__ import annotations

import os
import sys

FORCE = "--force" in sys.argv[1:]
if FORCE:  # read by XLA when the GPU backend starts: before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()

import jax  # noqa: E402

from bench.suites.attention import _attention_inputs, _backward, _pullback  # noqa: E402
from bench.timing import print_table, record, time_jax, time_torch  # noqa: E402

SHAPES = [(4, 4096, 64, 8, 64), (4, 4096, 32, 8, 128)]  # B, S, Hq, Hkv, D (the attention table's)


def _same(a, b) -> bool:
    return all(bool((x == y).all()) for x, y in zip(a, b))


def _jax_row(case, name, fn, q, k, v, ct, flops):
    pull = _pullback(fn, q, k, v)
    record(case, name, lambda: time_jax(_backward, pull, ct), flops)
    print(f"  {case} / {name}: two runs bitwise equal: {_same(pull(ct), pull(ct))}", flush=True)


def _torch_row(case, name, q, k, v, flops):
    import torch
    tq, tk, tv = (torch.from_dlpack(x).permute(0, 2, 1, 3).contiguous().requires_grad_(True) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
    g = torch.randn_like(out)
    grads = lambda: torch.autograd.grad(out, (tq, tk, tv), g, retain_graph=True)
    record(case, name, lambda: time_torch(grads), flops)
    print(f"  {case} / {name}: two runs bitwise equal: {_same(grads(), grads())}", flush=True)


def main() -> None:
    import torch
    from tessera.lower.kernels.flash_attention import attention_flops, flash_attention
    torch.use_deterministic_algorithms(FORCE)
    mode = "peers deterministic" if FORCE else "peers default"
    print(f"devices: {jax.devices()}  jax {jax.__version__}  torch {torch.__version__}  ({mode})")
    for b, s, hq, hkv, d in SHAPES:
        q, k, v, ct, _ = _attention_inputs(b, s, hq, hkv, d)
        flops = 2.5 * attention_flops(b, s, s, hq, d, causal=True, window=None)
        case = f"attn bwd B{b} S{s} H{hq}/{hkv} D{d} causal ({mode})"
        _jax_row(case, "tessera (mosaic gpu)", lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, ct, flops)
        _jax_row(case, "cuDNN (jax.nn.dpa)", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"), q, k, v, ct, flops)
        _torch_row(case, "torch SDPA", q, k, v, flops)
    print_table()


if __name__ == "__main__":
    main()
