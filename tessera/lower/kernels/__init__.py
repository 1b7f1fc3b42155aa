"""Pallas (Mosaic GPU, Hopper) kernels, each beside the reference it matches.

| module | public op | fallback test |
|---|---|---|
| flash_attention | flash_attention(q, k, v, *, sinks, causal, window, scale, q_offset, config) | supported(...) |
| decode_attention | decode_attention(q, k, v, *, kv_len, q_offset, sinks, causal, window, scale, config) | supported(...) |
| grouped_matmul | grouped_matmul(lhs, rhs, group_sizes, *, config) | supported(...) |
| mxfp4_matmul (Triton backend) | ragged_dot(lhs, rhs: MXFP4, group_sizes, *, preferred_element_type, config), matmul(x, w, *, config), pair_dot(lhs, rhs: MXFP4, experts, *, preferred_element_type, config) | supported(...), supported_pairs(...) |
| mxfp4_gemv (Triton backend) | the matrix-vector kernel behind mxfp4_matmul.pair_dot at decode | (through pair_dot) |
| rms_norm (Triton backend) | rms_norm(x, scale, *, eps, config), add_rms_norm(x, residual, scale, *, eps, config) | supported(...) -> (ok, why) |

Each `supported()` is False without its GPU (unless a config asks for the CPU interpreter): Hopper
for the Mosaic GPU kernels, compute capability 8.0+ for mxfp4_matmul, any CUDA GPU for rms_norm;
the lowering keeps the `jax.numpy` reference there. Modules import Pallas lazily: import them only
where a kernel may run.
"""
