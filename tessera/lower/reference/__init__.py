"""Reference semantics of Tessera's ops in plain `jax.numpy`/`lax`. Kernels must match these."""
