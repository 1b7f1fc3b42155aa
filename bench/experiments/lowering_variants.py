"""Lowering variants the experiments patch in (decode_variants, train_variants, fp8_train_forms), and `patched`, the
context that swaps them in and back: one function of the lowering replaced while a program traces."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from tessera.lower.reference import fp8


@contextlib.contextmanager
def patched(patches):
    """Within: each (module, name, fn) of `patches` in place of module.name (or of module[name] where module is a
    dict: a registry such as tessera.lower.table.LOWERINGS); afterwards the originals again."""
    def get(m, name):
        return m[name] if isinstance(m, dict) else getattr(m, name)

    def put(m, name, value):
        if isinstance(m, dict):
            m[name] = value
        else:
            setattr(m, name, value)

    old = [(m, name, get(m, name)) for m, name, _ in patches]
    try:
        for m, name, fn in patches:
            put(m, name, fn)
        yield
    finally:
        for m, name, fn in old:
            put(m, name, fn)


_QUANTIZE_DELAYED = fp8.quantize_delayed  # the built form: the variants below replace it while they run


def history_only(x, row, dtype, fallback=None):
    """`reference.fp8.quantize_delayed` with no operand falling back to its current amax while the history is empty
    (then scale 1): the gradient too, whose built form falls back (at scale 1 a step-1 gradient underflows e5m2)."""
    del fallback
    return _QUANTIZE_DELAYED(x, row, dtype)


def every_operand_falls_back(x, row, dtype, fallback=None):
    """`reference.fp8.quantize_delayed` as it was until session 33: every operand, inputs and weights too, scaled
    from its current amax while its history is empty, a select that keeps each operand's amax reduction ahead of its
    cast (264.0 ms a Llama-1B step on one H100 against the built form's 249.9)."""
    return _QUANTIZE_DELAYED(x, row, dtype, fp8.amax_of(x) if fallback is None else fallback)


_PRODUCT = fp8.scaled_product


def barrier_before_weight_gradient(spec, a_q, b_q, scale, accum, out_dtype, precision=None):
    """`reference.fp8.scaled_product` with the weight gradient's operands (the forward's e4m3 x_q and the e5m2
    gradient g_q, the one product whose second operand is e5m2) behind an optimization barrier. cuBLASLt's fp8 GEMM takes both
    operands contiguous along K (here the tokens), so XLA transposes them; in the Llama-1B step (session 45 profile)
    it fused those transposes into the fusions that compute and quantise the gradient (SwiGLU's backward: 1.17 ms a
    layer, ~2.5x its bytes' time, the transposed writes the slow part). Behind the barrier the quantising fusion
    writes g_q in one layout and the transpose is an fp8 copy of its own."""
    if jnp.dtype(b_q.dtype) == jnp.dtype(fp8.E5M2):
        a_q, b_q = jax.lax.optimization_barrier((a_q, b_q))
    return _PRODUCT(spec, a_q, b_q, scale, accum, out_dtype, precision)

