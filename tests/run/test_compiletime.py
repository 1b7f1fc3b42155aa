"""compile_phases: the seconds JAX spent tracing, lowering and compiling inside a block."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.run.compiletime import compile_phases


def test_a_first_call_counts_each_phase_and_a_cached_call_none():
    fn = jax.jit(lambda x: jnp.sin(x) @ x.T + 1.0)
    x = jnp.ones((8, 8))
    with compile_phases() as outer:
        with compile_phases() as first:
            fn(x).block_until_ready()
        with compile_phases() as again:
            fn(x).block_until_ready()
    assert set(first) == {"trace_s", "lower_s", "backend_s"}
    assert all(v > 0 for v in first.values()), first
    assert again == {"trace_s": 0.0, "lower_s": 0.0, "backend_s": 0.0}
    assert outer == first  # nested blocks each count
    with compile_phases() as other:  # a closed block no longer counts
        fn(jnp.ones((4, 4))).block_until_ready()
    assert other["backend_s"] > 0 and outer == first
