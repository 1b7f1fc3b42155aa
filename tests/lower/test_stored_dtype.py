"""Matmuls under `bf16 @accum(fp32)` write bf16: one rounding of an fp32 accumulation."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import tessera
from tessera.lower.named import einsum, stored_dtype

TINY = Path(__file__).resolve().parents[2] / "specs" / "gpt_oss_tiny.yaml"


def test_bf16_store_is_the_cast_of_the_fp32_result():
    """Storing bf16 rounds the fp32 accumulation once: bitwise the cast of the fp32 result
    (K = 3000 products, so a bf16 accumulation would differ)."""
    ka, kb = jax.random.split(jax.random.key(3))
    x = jax.random.normal(ka, (5, 3000), jnp.bfloat16)
    w = jax.random.normal(kb, (3000, 70), jnp.bfloat16)
    spec = ([("t", "e"), ("e", "v")], ("t", "v"))
    got = einsum(*spec, x, w, store=jnp.bfloat16)
    want = einsum(*spec, x, w).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # operands of another type keep the accumulator's type
    assert einsum(*spec, x.astype(jnp.float32), w, store=jnp.bfloat16).dtype == jnp.float32


def test_partial_sums_stay_in_the_accumulator_type():
    assert stored_dtype(jnp.bfloat16, jnp.float32) == jnp.bfloat16
    assert stored_dtype(jnp.bfloat16, jnp.float32, partial=True) == jnp.float32


def _weight_dots(prog, params, tokens):
    """{weight operand shape: result dtypes} of the forward's bf16 x bf16 dot_generals."""
    jaxpr = jax.make_jaxpr(prog.forward)(params, tokens)
    found: dict[tuple, list[str]] = {}

    def walk(jx):
        for eqn in jx.eqns:
            ins = eqn.invars[:2]
            if eqn.primitive.name == "dot_general" and all(v.aval.dtype == jnp.bfloat16 for v in ins):
                found.setdefault(tuple(ins[1].aval.shape), []).append(str(eqn.outvars[0].aval.dtype))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jaxpr.jaxpr)
    return found


def test_bf16_model_projections_write_bf16():
    """gpt_oss_tiny in bf16 (2 layers, d_model 128, 4 heads / 2 KV heads of 32, 4 experts, vocab
    256): the q/k/v/o projections and the unembedding write bf16; the router (expert choice is
    precision-sensitive) and the attention scores stay fp32."""
    exp = tessera.load(TINY, overrides={"numerics.default": "bf16 @accum(fp32)", "numerics.params": "bf16"})
    prog = tessera.compile(exp)
    # 2 x 40 tokens: more than ROUTER_ROWS_MAX, so the router is one dot (fewer sum fp32 blocks, no dot)
    found = _weight_dots(prog, prog.init(seed=0), jnp.zeros((2, 40), jnp.int32))
    assert found[(128, 4, 32)] == ["bfloat16"] * 2  # q, per layer
    assert found[(128, 2, 32)] == ["bfloat16"] * 4  # k and v
    assert found[(4, 32, 128)] == ["bfloat16"] * 2  # o
    assert found[(128, 256)] == ["bfloat16"]  # unembedding
    assert found[(128, 4)] == ["float32"] * 2  # router
