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
