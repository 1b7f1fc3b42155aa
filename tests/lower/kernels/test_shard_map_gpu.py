"""Kernels inside `jax.shard_map` with check_vma (how the fast sharded lowering calls them): each output states
the mesh axes it varies over, and forward and gradients match the reference. GPU cases run with `pytest -m gpu`;
the out_shape helper is checked on the CPU through the Pallas interpreter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tessera.lower.kernels._vma import common, out_struct


def _mesh():
    return jax.make_mesh((1,), ("x",))


def _put(mesh, a, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))


def test_out_struct_follows_the_inputs_varying_axes():
    """(The Pallas interpreter itself cannot run under check_vma: it mixes varying refs with constants.)"""
    mesh = jax.make_mesh((1, 1), ("a", "b"))
    seen = {}

    def f(x, y):
        seen["in"] = [jax.typeof(v).manual_axis_type.varying for v in (x, y)]
        x2, y2 = common(x, y)
        seen["common"] = [jax.typeof(v).manual_axis_type.varying for v in (x2, y2)]
        seen["out"] = out_struct((3,), jnp.float32, x, y).manual_axis_type.varying
        return x2 + y2

    x = _put(mesh, jnp.arange(8.0).reshape(2, 4), P("a"))
    y = _put(mesh, jnp.ones((2, 4)), P(None, "b"))
    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("a"), P(None, "b")), out_specs=P("a", "b")))(x, y)
    np.testing.assert_array_equal(np.asarray(out), np.arange(8.0).reshape(2, 4) + 1)
    assert seen["in"] == [frozenset({"a"}), frozenset({"b"})]
    assert seen["common"] == [frozenset({"a", "b"})] * 2 and seen["out"] == frozenset({"a", "b"})
    assert out_struct((2,), jnp.float32, jnp.ones(2)) == jax.ShapeDtypeStruct((2,), jnp.float32)  # nothing varies


@pytest.mark.gpu
def test_flash_attention_under_shard_map():
    from tessera.lower.kernels import flash_attention as fa

    mesh, rng = _mesh(), np.random.default_rng(0)
    q = _put(mesh, jnp.asarray(rng.normal(size=(2, 256, 8, 64)), jnp.bfloat16), P("x"))
    k = _put(mesh, jnp.asarray(rng.normal(size=(2, 256, 2, 64)), jnp.bfloat16), P("x"))
    v = _put(mesh, jnp.asarray(rng.normal(size=(2, 256, 2, 64)), jnp.bfloat16), P("x"))
    sinks = _put(mesh, jnp.asarray(rng.normal(size=(8,)), jnp.float32), P())

    def loss(fn):
        def f(q, k, v, s):
            o = fn(q, k, v, sinks=s, causal=True, window=128, scale=0.125)
            return jax.lax.psum(jnp.sum(o.astype(jnp.float32) ** 2), "x")
        return jax.jit(jax.value_and_grad(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 3 + (P(),),
                                                         out_specs=P()), argnums=(0, 3)))

    (a, ga), (r, gr) = loss(fa.flash_attention)(q, k, v, sinks), loss(fa.flash_attention_reference)(q, k, v, sinks)
    assert abs(float(a) - float(r)) < 2e-2 * abs(float(r))
    for x, y in zip(ga, gr):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.linalg.norm(x - y) < 5e-2 * np.linalg.norm(y)


@pytest.mark.gpu
def test_grouped_and_mxfp4_matmul_under_shard_map():
    from tessera.lower.kernels import grouped_matmul as gm, mxfp4_matmul as mk
    from tessera.lower.reference import mxfp4 as ref

    mesh, rng = _mesh(), np.random.default_rng(1)
    m, k, n, g = 512, 256, 384, 4
    x = _put(mesh, jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16), P())
    w = _put(mesh, jnp.asarray(rng.normal(size=(g, k, n)) * 0.05, jnp.bfloat16), P(None, None, "x"))
    sizes = jnp.asarray([200, 0, 250, 62], jnp.int32)
    packed = ref.quantize(jnp.asarray(rng.normal(size=(g, k, n)), jnp.float32))
    codes, scales = _put(mesh, packed.codes, P(None, None, "x")), _put(mesh, packed.scales, P(None, None, "x"))
    run = lambda f, specs: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P(None, "x")))  # noqa: E731
    out = run(lambda a, b: gm.grouped_matmul(a, b, sizes), (P(), P(None, None, "x")))(x, w)
    want = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)
    fn = lambda a, c, s: mk.ragged_dot(a, ref.MXFP4(c, s), sizes)  # noqa: E731
    out = run(fn, (P(), P(None, None, "x"), P(None, None, "x")))(x, codes, scales)
    want = ref.ragged_dot(x, packed, sizes, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=2e-2, atol=5e-2)
