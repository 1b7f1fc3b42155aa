"""The fused SwiGLU-gradient quantisation (bench/experiments/fp8_cast_transpose.py) in the Pallas interpreter
against the step's form (XLA: the VJP of reference/activations.swiglu, quantise, transpose)."""

from __future__ import annotations

import jax

from bench.experiments.fp8_cast_transpose import compare, inputs, reference, swiglu_grad_e5m2


def test_the_kernel_writes_the_steps_codes_in_both_layouts():
    args = inputs(128, 256, seed=1)
    got = jax.jit(lambda *a: swiglu_grad_e5m2(*a, bm=64, bf=128, interpret=True))(*args)
    want = jax.jit(reference)(*args)
    assert got[1].shape == (256, 128) and got[1].dtype == want[1].dtype
    cmp = compare(got, want)
    for name in ("gate", "gate.T", "up", "up.T"):
        mismatched, steps = cmp[name]
        assert mismatched <= 0.001 * 128 * 256 and steps <= 1, (name, cmp[name])
    ga, wa, ua, wu = cmp["amax"]
    assert abs(ga - wa) <= 2 ** -7 * wa and abs(ua - wu) <= 2 ** -7 * wu, cmp["amax"]
    assert cmp["gate"][0] == cmp["gate.T"][0] and cmp["up"][0] == cmp["up.T"][0]  # the transposes are the codes'
