"""Loss scaling for fp16 training (tessera/lower/loss_scale.py): a tiny fp16 model whose gradients all underflow
unscaled trains with dynamic scaling, with the fp32 model's gradient; overflowing steps are skipped, counted and
halve the scale; clean runs double it; the scale is train state (checkpointed with it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

from tessera.cli import main
from tessera.lower import loss_scale
from tessera.lower.program import compile_experiment
from tessera.run.optim import build_optimizer, current_lr
from tessera.spec import load_experiment

# logits scaled by 2^-20: the loss's gradient reaching the fp16 logits is ~2^-6 / 64 tokens, times 2^-20 below
# fp16's smallest subnormal (2^-24), so every gradient is exactly zero unless the loss is scaled
MODEL = """model tiny(vocab: int, d_model: int) {
  forward(tokens: i32[batch, seq]) {
    x = embed(tokens, vocab, d_model)
    x = x + mlp(rmsnorm(x, eps = 1e-5) as norm, d_ff = 32)
    return unembed(x, vocab) * 0.00000095367431640625
  }
}
"""


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    d = tmp_path_factory.mktemp("loss_scale")
    (d / "tiny.tsl").write_text(MODEL)
    (d / "tiny.yaml").write_text(yaml.safe_dump({
        "name": "tiny", "model": {"file": "tiny.tsl", "args": {"vocab": 32, "d_model": 16}},
        "numerics": {"default": "fp16", "params": "fp32"}, "parallel": {"deterministic": False},
        "task": {"kind": "train", "seed": 0, "steps": 3, "batch": 4, "seq_len": 16,
                 "optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.0}}}))
    return str(d / "tiny.yaml")


def _steps(spec, n=2, eager=True, **over):
    exp = load_experiment(spec, overrides=over)
    prog = compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)
    state = prog.init_train_state(prog.init(0))
    first = jax.tree.map(np.asarray, state.params)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 32, (4, 16)), jnp.int32)
    batch = {"tokens": toks, "targets": jnp.roll(toks, 1, axis=1), "mask": jnp.ones((4, 16), jnp.float32)}
    # op by op: XLA:CPU's fusions keep fp16 intermediates in fp32 and move the scalar factor through the dot
    # (dot(g·c, w) = dot(g, w)·c), which hides the underflow a GPU's fp16 kernels show; eagerly each op is fp16
    out = []
    for _ in range(n):
        if eager:
            with jax.disable_jit():
                state, m = prog.train_step_fn()(state, batch)
        else:
            state, m = prog.train_step(state, batch)
        out.append(jax.device_get(m))
    moved = max(float(np.max(np.abs(np.asarray(state.params[k]) - first[k]))) for k in first)
    return out, moved


@pytest.fixture(scope="module")
def runs(spec):
    return {"fp32": _steps(spec, **{"numerics.default": "fp32"}), "fp16": _steps(spec),
            "dynamic": _steps(spec, **{"numerics.loss_scale": "dynamic"}),
            "static": _steps(spec, **{"numerics.default": "fp16 @loss_scale(65536)"}),
            # the deterministic train step (the default), jitted
            "deterministic": _steps(spec, n=1, eager=False, **{"numerics.loss_scale": "dynamic",
                                                              "parallel.deterministic": True})}


def test_unscaled_fp16_gradients_underflow_and_scaling_recovers_them(runs):
    (m32, _), _ = runs["fp32"]
    (m16, *_), moved16 = runs["fp16"]
    assert m32["grad_norm"] > 0
    assert m16["grad_norm"] == 0.0 and moved16 == 0.0  # every gradient flushed to zero: nothing trains
    assert "loss_scale" not in m16
    for name, scale in [("dynamic", 2.0 ** 15), ("static", 65536.0), ("deterministic", 2.0 ** 15)]:
        (m, *_), moved = runs[name]
        assert m["loss_scale"] == scale and m["skipped_steps"] == 0
        assert m["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.05)  # the fp32 model's gradient
        assert m["loss"] == pytest.approx(m16["loss"], abs=1e-4)  # reported unscaled (scaled: 2^15 times)
        assert moved > 1e-4


def test_overflow_skips_and_halves_clean_steps_double():
    params = {"w": jnp.ones((3,), jnp.float32)}
    opt = loss_scale.loss_scaled(optax.adam(0.1), kind="dynamic", init=8.0, interval=2)
    state = opt.init(params)
    inner0 = jax.tree.map(np.asarray, state[1])
    upd, state = opt.update({"w": jnp.array([1.0, jnp.inf, 0.0])}, state, params)
    assert np.all(np.asarray(upd["w"]) == 0)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), inner0, state[1]))
    assert (float(state[0].scale), int(state[0].skipped), int(state[0].good)) == (4.0, 1, 0)
    for want in (4.0, 8.0):  # two clean steps: the scale doubles once
        upd, state = opt.update({"w": jnp.ones((3,))}, state, params)
        assert float(state[0].scale) == want
    assert np.all(np.asarray(upd["w"]) != 0) and int(state[0].skipped) == 1
    static = loss_scale.loss_scaled(optax.sgd(0.1), kind="static", init=8.0)
    _, s = static.update({"w": jnp.array([jnp.nan, 0.0, 0.0])}, static.init(params), params)
    assert (float(s[0].scale), int(s[0].skipped)) == (8.0, 1)


def test_the_scale_is_checkpointed_train_state(spec, tmp_path):
    from tessera.run.checkpoint import Checkpoints

    exp = load_experiment(spec, overrides={"numerics.loss_scale": "dynamic"})
    prog = compile_experiment(exp, optimizer=build_optimizer(exp))
    state = prog.init_train_state(prog.init(0))
    ls = loss_scale.state_of(state.opt_state)
    state = state._replace(opt_state=(ls._replace(scale=jnp.float32(512.0), good=jnp.int32(7),
                                                  skipped=jnp.int32(3)), state.opt_state[1]))
    ck = Checkpoints(tmp_path / "ckpt", keep=2)
    ck.save(1, state, {"spec": {}, "metrics": [], "data_step": 1})
    ck.wait()
    back, _ = ck.restore(1, prog.init_train_state(prog.init(0)))
    got = loss_scale.state_of(back.opt_state)
    assert (float(got.scale), int(got.good), int(got.skipped)) == (512.0, 7, 3)


def test_check_refuses_loss_scaling_where_it_would_not_run(spec, capsys):
    assert main(["check", spec, "--set", "numerics.loss_scale=dynamic"]) == 0
    capsys.readouterr()
    assert main(["check", spec, "--set", "numerics.loss_scale=static(8)", "--set",
                 "numerics.default=fp16 @loss_scale(dynamic)"]) == 2
    assert "numerics.loss_scale: numerics.loss_scale `static(8)` and numerics.default's `@loss_scale(dynamic)` " \
           "disagree" in capsys.readouterr().err
    assert main(["check", spec, "--set", "numerics.rules={\"*/mlp/up\": \"fp16 @loss_scale(8)\"}"]) == 2
    assert "rule `*/mlp/up`: `@loss_scale(8.0)` on a rule would not be honoured" in capsys.readouterr().err
