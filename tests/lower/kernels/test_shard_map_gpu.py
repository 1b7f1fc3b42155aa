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
    # Auto axes, as Tessera's meshes (jax >= 0.11 makes Explicit ones by default)
    return jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


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
    want = jax.lax.ragged_dot(np.asarray(x), np.asarray(w), sizes, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)
    # gradients: the custom VJP's cotangents take their primals' varying axes (x replicated, w split)
    def loss(f):
        g = lambda a, b: jax.lax.psum(jnp.sum(f(a, b, sizes).astype(jnp.float32) ** 2), "x")  # noqa: E731
        return jax.jit(jax.value_and_grad(jax.shard_map(g, mesh=mesh, in_specs=(P(), P(None, None, "x")),
                                                         out_specs=P()), argnums=(0, 1)))
    (a, ga), (r, gr) = loss(gm.grouped_matmul)(x, w), loss(gm.grouped_matmul_reference)(x, w)
    assert abs(float(a) - float(r)) < 1e-2 * abs(float(r))
    for got, want in zip(ga, gr):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(got - want) < 2e-2 * np.linalg.norm(want)
    fn = lambda a, c, s: mk.ragged_dot(a, ref.MXFP4(c, s), sizes)  # noqa: E731
    out = run(fn, (P(), P(None, None, "x"), P(None, None, "x")))(x, codes, scales)
    want = ref.ragged_dot(x, packed, sizes, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
def test_sharded_loss_runs_the_verified_kernels():
    """The fast sharded loss (shard_map with check_vma, every mesh axis named) picks the kernels of
    the lowering table (in_shard_map) and agrees with the one-device program that runs the same kernels."""
    import tessera
    from tessera.lower.program import Program
    from tessera.lower import table
    from tessera.lower.shard.step import make_plan
    from tests.lower.conftest import GPT_OSS_TINY, GPU_BF16

    one = tessera.compile(tessera.load(GPT_OSS_TINY, overrides=GPU_BF16))
    plan = make_plan(one.options, one.graph, jax.devices()[:1])  # dp, fsdp, tp, ... all named, all of size 1
    sharded = Program(one.options, one.graph, ir_hash=one.ir_hash, plan=plan)
    report = sharded.kernel_report()
    chosen = set(report.values())
    verified = {k.short for ks in table._table()[1].values() for k in ks if k.in_shard_map}
    assert {"flash_attention", "grouped_matmul"} <= verified
    assert any(c.startswith("flash_attention") for c in chosen), report
    assert any(c.startswith("grouped_matmul") for c in chosen), report
    params = one.init(0)
    tokens = np.random.default_rng(0).integers(0, 256, (4, 512)).astype(np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, 1), "mask": np.ones(tokens.shape, np.float32)}
    (ls, gs), (lo, go) = (jax.jit(jax.value_and_grad(p.loss_fn()))(params, batch) for p in (sharded, one))
    assert abs(float(ls) - float(lo)) < 1e-3 * abs(float(lo))
    for path in ("layers/attention/q", "layers/attention/sinks", "layers/moe/experts/gate"):
        x, y = np.asarray(gs[path], np.float32), np.asarray(go[path], np.float32)
        assert np.linalg.norm(x - y) <= 2e-2 * np.linalg.norm(y), path
