"""The optimizer and schedules built from a task."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tessera.run.optim import build_optimizer, build_schedule, current_lr, decay_mask


def _exp(kind="warmup_cosine", name="adamw", clip=1.0, wd=0.1, steps=100, warmup=10, ratio=0.1):
    opt = types.SimpleNamespace(name=name, lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd, clip_norm=clip,
                                momentum=0.0)
    sched = types.SimpleNamespace(kind=kind, warmup_steps=warmup, min_lr_ratio=ratio)
    return types.SimpleNamespace(task=types.SimpleNamespace(steps=steps, optimizer=opt, schedule=sched))


def test_schedules():
    cos = build_schedule(_exp())
    assert float(cos(0)) == 0.0 and np.isclose(float(cos(5)), 5e-3) and np.isclose(float(cos(10)), 1e-2)
    assert np.isclose(float(cos(100)), 1e-3) and np.isclose(float(cos(55)), 1e-3 + 0.5 * (1e-2 - 1e-3), rtol=1e-5)
    lin = build_schedule(_exp("linear"))
    assert np.isclose(float(lin(55)), 1e-2 - 0.5 * (1e-2 - 1e-3), rtol=1e-5) and np.isclose(float(lin(100)), 1e-3)
    const = build_schedule(_exp("constant", warmup=0))
    assert float(const(0)) == float(const(99)) == pytest.approx(1e-2)


def test_adamw_clips_decays_matrices_only_and_reports_lr():
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,))}
    grads = {"w": jnp.full((2, 2), 100.0), "b": jnp.zeros((2,))}
    opt = build_optimizer(_exp(warmup=0, kind="constant"))
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    assert float(current_lr(state)) == pytest.approx(1e-2)
    # first Adam step moves each coordinate by ~lr; decay adds lr*wd*w to matrices only
    assert np.allclose(updates["w"], -(1e-2 + 1e-2 * 0.1), rtol=1e-4)
    assert np.allclose(updates["b"], 0.0)
    assert decay_mask(params) == {"w": True, "b": False}
    clipped = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())[0]
    assert np.isclose(float(optax.tree.norm(clipped)), 1.0)


def test_state_structure_same_with_or_without_clipping_and_sgd():
    params = {"w": jnp.ones((2, 2))}
    a = build_optimizer(_exp(clip=1.0)).init(params)
    b = build_optimizer(_exp(clip=None)).init(params)
    assert jax.tree.structure(a) == jax.tree.structure(b)  # a checkpoint restores either way
    sgd = build_optimizer(_exp(name="sgd", kind="constant", warmup=0, wd=0.0, clip=None))
    upd, _ = sgd.update({"w": jnp.ones((2, 2))}, sgd.init(params), params)
    assert np.allclose(upd["w"], -1e-2)
    with pytest.raises(ValueError, match="unknown optimizer"):
        build_optimizer(_exp(name="lion"))


@pytest.mark.parametrize("name,clip,scaled", [("adamw", 0.5, False), ("sgd", 0.5, False), ("adamw", None, False),
                                              ("adamw", 0.5, True)])
def test_blocks_updated_with_the_whole_gradients_norm_are_the_whole_update(name, clip, scaled):
    """Deterministic mode updates each device's block of a parameter, handing the optimizer the whole gradient's
    norm (clipping) and finiteness (loss scaling): the blocks are the whole tensor's update, bit for bit. Without
    the norm, a block would clip by its own (smaller) norm."""
    from tessera.lower import loss_scale

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32), "b": jnp.asarray(rng.normal(size=(8,)),
                                                                                         jnp.float32)}
    grads = {k: jnp.asarray(rng.normal(size=v.shape) * 3, jnp.float32) for k, v in params.items()}
    opt = build_optimizer(_exp(name=name, clip=clip, warmup=0, kind="constant"))
    if scaled:
        grads["b"] = grads["b"].at[5].set(jnp.inf)  # in the second block only: the whole step is skipped
        opt = loss_scale.loss_scaled(opt, kind="dynamic", init=8.0)
    norm, finite = optax.tree.norm(grads), loss_scale.all_finite_of(grads)
    assert float(norm) > 0.5 or scaled  # the whole gradient is clipped
    whole, whole_state = opt.update(grads, opt.init(params), params)
    for half in (slice(0, 4), slice(4, 8)):
        block = lambda t: jax.tree.map(lambda a: a[half], t)  # noqa: E731
        got, state = opt.update(block(grads), opt.init(block(params)), block(params), global_norm=norm,
                                all_finite=finite)
        for k in params:
            np.testing.assert_array_equal(got[k], whole[k][half])
        if scaled:
            assert int(loss_scale.state_of(state).skipped) == 1 and float(loss_scale.state_of(state).scale) == 4.0
    if name == "sgd":  # a block clipped by its own norm moves otherwise
        own, _ = opt.update(block(grads), opt.init(block(params)), block(params))
        assert not np.array_equal(own["w"], whole["w"][half])
