"""Pallas (Mosaic GPU, Hopper) kernels, each beside the reference it matches.

| module | public op | fallback test |
|---|---|---|
| flash_attention | flash_attention(q, k, v, *, sinks, causal, window, scale, q_offset, config) | supported(...) |
| decode_attention | decode_attention(q, k, v, *, kv_len, q_offset, sinks, causal, window, scale, config) | supported(...) |
| grouped_matmul | grouped_matmul(lhs, rhs, group_sizes, *, config) | supported(...) |
| grouped_swiglu (not selected yet) | grouped_swiglu(x, gate, up, group_sizes, *, gate_bias, up_bias, alpha, limit, config) | supported(...) |
| mxfp4_matmul (Triton backend) | ragged_dot(lhs, rhs: MXFP4, group_sizes, *, preferred_element_type, config), matmul(x, w, *, config) | supported(...) |
| rms_norm (Triton backend) | rms_norm(x, scale, *, eps, config), add_rms_norm(x, residual, scale, *, eps, config) | supported(...) -> (ok, why) |

Each `supported()` is False without its GPU (unless a config asks for the CPU interpreter): Hopper
for the Mosaic GPU kernels, compute capability 8.0+ for mxfp4_matmul, any CUDA GPU for rms_norm;
the lowering keeps the `jax.numpy` reference there. Modules import Pallas lazily: import them only
where a kernel may run.
"""
