"""The fused SwiGLU-gradient quantisation (bench/experiments/fp8_cast_transpose.py) in the Pallas interpreter
against the step's form (XLA: the VJP of reference/activations.swiglu, quantise, transpose)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.experiments.fp8_cast_transpose import (cast_reference, cast_transpose_e5m2, compare, inputs, reference,
                                                  swiglu_grad_e5m2)


def test_the_kernel_writes_the_steps_codes_in_both_layouts():
    args = inputs(128, 256, seed=1)
    got = jax.jit(lambda *a: swiglu_grad_e5m2(*a, bm=64, bf=128, interpret=True))(*args)
    want = jax.jit(reference)(*args)
    assert got[1].shape == (256, 128) and got[1].dtype == want[1].dtype
    cmp = compare(got, want)
    for i in range(4):  # gate, gate.T, up, up.T
        mismatched, steps = cmp[i]
        assert mismatched <= 0.001 * 128 * 256 and steps <= 1, (i, cmp[i])
    for a, w in cmp["amax"]:
        assert abs(a - w) <= 2 ** -7 * w, cmp["amax"]
    assert cmp[0][0] == cmp[1][0] and cmp[2][0] == cmp[3][0]  # the transposes are the codes'


def test_the_plain_kernel_writes_xlas_codes_both_ways():
    """The logits' gradient's cast-transpose: the codes, their transpose and the amax exactly as XLA's."""
    g = (1e-6 * jax.random.normal(jax.random.key(2), (128, 384))).astype(jnp.bfloat16)
    scale = jnp.asarray([2.0 ** 26], jnp.float32)
    got = jax.jit(lambda g, s: cast_transpose_e5m2(g, s, bm=64, bn=128, interpret=True))(g, scale)
    want = jax.jit(cast_reference)(g, scale)
    cmp = compare(got, want)
    assert cmp[0] == (0, 0) and cmp[1] == (0, 0) and cmp["amax"][0][0] == cmp["amax"][0][1], cmp
    assert got[1].shape == (384, 128)
