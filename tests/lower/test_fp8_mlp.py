"""The MLP's gate, up, SwiGLU and down as one custom VJP under delayed fp8 scaling (tessera/lower/fp8_mlp.py): a tiny
Llama trains through it bit for bit as through the three products one by one (the form it replaces), the first step
(empty gradient histories: scales from the gradients' amaxes) included; it applies where it should and nowhere
else. (The kernel that computes its backward on a GPU against the reference it calls here:
tests/lower/kernels/test_fp8_cast.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower import fp8_mlp, program
from tessera.lower.program import compile_experiment
from tessera.run.optim import build_optimizer
from tessera.spec import load_experiment
from tests.lower.shard.make_snapshots import ROOT

ARGS = {"d_model": 32, "d_ff": 64, "head_dim": 8, "heads": 4, "kv_heads": 2, "vocab": 64, "layers": 2}
DELAYED = "fp8_e4m3 @scale(delayed(4)) @accum(fp32)"


def _train(monkeypatch, fused: bool, policy: str = DELAYED, steps: int = 3, **extra):
    """(losses, final state on the host, the calls of fp8_mlp.mlp while tracing) of a tiny Llama learning one
    batch."""
    calls = []
    built = fp8_mlp.mlp
    monkeypatch.setattr(fp8_mlp, "mlp", lambda *a, **k: calls.append(a[1]) or built(*a, **k))
    if not fused:
        monkeypatch.setattr(fp8_mlp, "applies", lambda *a: False)
    over = {"numerics.default": policy, "task.batch": 4, "task.seq_len": 16, "task.optimizer.lr": 1e-2,
            "parallel.deterministic": False, **{f"model.args.{k}": v for k, v in ARGS.items()}, **extra}
    exp = load_experiment(str(ROOT / "specs" / "llama_tiny.yaml"), overrides=over)
    program._PROGRAMS.clear()
    prog = compile_experiment(exp, optimizer=build_optimizer(exp))
    program._PROGRAMS.clear()
    seq = jnp.asarray(np.random.default_rng(0).integers(1, 64, (4, 16)), jnp.int32)
    batch = {"tokens": seq, "targets": jnp.roll(seq, -1, 1), "mask": jnp.ones((4, 16), jnp.float32)}
    state, losses = prog.init_train_state(prog.init(0)), []
    for _ in range(steps):
        state, m = prog.train_step(state, batch)
        losses.append(float(m["loss"]))
    monkeypatch.undo()
    return np.array(losses), jax.device_get(state), calls


def test_the_fused_mlp_trains_as_the_products_one_by_one_bit_for_bit(monkeypatch):
    fused, s_fused, calls = _train(monkeypatch, fused=True)
    one_by_one, s_one, none = _train(monkeypatch, fused=False)
    assert calls == ["layers/mlp"] and none == []  # traced once: the unrolled layer
    np.testing.assert_array_equal(fused, one_by_one)
    assert fused[-1] < fused[0]
    for a, b in zip(jax.tree.leaves(s_fused), jax.tree.leaves(s_one)):  # parameters, moments, amax histories
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    history = s_fused.opt_state.history["layers/mlp/gate#amax_history"]
    assert history.shape == (2, 3, 4) and np.all(history[:, :, :3] > 0)  # three steps of x, w, g amaxes a layer


@pytest.mark.parametrize("policy,extra", [("fp8_e4m3 @scale(per_tensor) @accum(fp32)", {}),
                                          ("bf16 @accum(fp32)", {}),
                                          (DELAYED, {"numerics.compute": {"*mlp": "bf16 @accum(fp32)"}})],
                         ids=["per_tensor", "bf16", "mlp in bf16 by a rule"])
def test_it_applies_to_delayed_fp8_mlps_only(monkeypatch, policy, extra):
    _, _, calls = _train(monkeypatch, fused=True, policy=policy, steps=1, **extra)
    assert calls == []
