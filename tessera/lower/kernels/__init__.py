"""Pallas (Mosaic GPU, Hopper) kernels, each beside the reference it matches.

| module | public op | fallback test |
|---|---|---|
| flash_attention | flash_attention(q, k, v, *, sinks, causal, window, scale, q_offset, config) | supported(...) |
| decode_attention | decode_attention(q, k, v, *, kv_len, q_offset, sinks, causal, window, scale, config) | supported(...) |
| grouped_matmul | grouped_matmul(lhs, rhs, group_sizes, *, config) | supported(...) |

Each `supported()` is False off Hopper (unless a config asks for the CPU interpreter), so the
lowering keeps the `jax.numpy` reference there. Modules import Pallas lazily: import them only
where a kernel may run.
"""
