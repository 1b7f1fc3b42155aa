"""`repeat` as a scan over stacked layers and unrolled over split ones (generation) compute the same."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera
from tessera.lower.context import LowerCtx
from tessera.lower.interpret import eval_region, init_state, split_layers

TINY = Path(__file__).resolve().parents[2] / "specs" / "gpt_oss_tiny.yaml"


@pytest.fixture(scope="module")
def tiny():
    """gpt_oss_tiny at 4 layers (period 2: sliding and full attention alternate), fp32, and its params; window 8
    (the spec's 16 would take 12 decode steps, each unrolled into the compiled program, to pass)."""
    prog = tessera.compile(tessera.load(TINY, overrides={"model.args.layers": 4, "model.args.window": 8}))
    return prog, prog.init(seed=0)


def _prefill_then_decode(prog, params, unroll: bool, tokens, steps: int):
    """Logits of a prefill and of `steps` decode steps, and the final KV state."""
    body = prog.graph.body
    b, p = tokens.shape
    ctx = LowerCtx(unroll=unroll)
    if unroll:
        params = split_layers(body, params)
    state = init_state(body, ctx.replace(mode="prefill"), b, p + steps)
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    (logits,), state = eval_region(body, [tokens], params, ctx.replace(mode="prefill", positions=pos), state)
    outs = [logits]
    token = jnp.argmax(logits[:, -1], axis=-1)
    for i in range(steps):
        pos = jnp.full((b, 1), p + i, jnp.int32)
        (logits,), state = eval_region(body, [token[:, None]], params, ctx.replace(mode="decode", positions=pos),
                                       state)
        outs.append(logits)
        token = jnp.argmax(logits[:, -1], axis=-1)
    return outs, state


def test_unrolled_layers_equal_the_scan(tiny):
    """Prefill of 7 tokens plus 4 decode steps (past the 8-token window): the same logits, and layer i's cache in
    the unrolled state is slice i of the scan's stacked one."""
    prog, params = tiny
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 7)), jnp.int32)
    run = jax.jit(lambda p, t, unroll: _prefill_then_decode(prog, p, unroll, t, 4), static_argnums=2)
    want, stacked = run(params, tokens, False)
    got, layers = run(params, tokens, True)
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    (key,) = [k for k in layers if isinstance(layers[k], list)]
    assert len(layers[key]) == 4
    for i, layer in enumerate(layers[key]):  # the scan stacks [n / period, ...] per slot of the period
        want_layer = jax.tree.map(lambda a: a[i // 2], stacked[key][i % 2])
        jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5),
                     layer, want_layer)


def test_split_layers_gives_each_layer_its_own_slice(tiny):
    prog, params = tiny
    split = split_layers(prog.graph.body, params)
    stacked = [k for k, v in split.items() if isinstance(v, list)]
    assert stacked and all(len(split[k]) == 4 for k in stacked)
    k = stacked[0]
    for i in range(4):
        np.testing.assert_array_equal(np.asarray(split[k][i]), np.asarray(params[k][i]))
    assert all(split[k] is params[k] for k in split if k not in stacked)  # embeddings etc. untouched


def test_unrolled_repeat_refuses_stacked_parameters(tiny):
    prog, params = tiny
    tokens = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="split_layers"):
        eval_region(prog.graph.body, [tokens], params, LowerCtx(mode="forward", unroll=True))
    # a train step (deterministic mode's shard loop) unrolls only a stack that comes split; one left whole stays a scan
    (got,), _ = eval_region(prog.graph.body, [tokens], params, LowerCtx(mode="train", unroll=True))
    (want,), _ = eval_region(prog.graph.body, [tokens], params, LowerCtx(mode="train"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    (split,), _ = eval_region(prog.graph.body, [tokens], split_layers(prog.graph.body, params),
                              LowerCtx(mode="train", unroll=True))
    np.testing.assert_allclose(np.asarray(split), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec, over", [
    ("gpt_oss_tiny.yaml", {"model.args.layers": 4}),  # MoE (its dropped-token counters leave each layer), period 2
    ("llama_tiny.yaml", {"numerics.default": "fp8_e4m3 @scale(delayed(4)) @accum(fp32)", "model.args.layers": 3})])
def test_a_fast_train_step_unrolls_its_stacked_layers_as_the_scan_computes(monkeypatch, spec, over):
    """Fast mode's train step on one device runs the stacked layers unrolled (layer i reads slice i of each stacked
    weight, of its held fp8 copy and amax history): the layers' scan gone from its jaxpr, and two steps give the
    scan's losses and counters, and its parameters and amax histories to a rounding (XLA:CPU fuses the two forms'
    backwards apart: after two Adam steps one weight in ~10^5 differs by ~1e-6)."""
    from tessera.lower import interpret, program

    exp = tessera.load(TINY.parent / spec, overrides={"parallel.deterministic": False, "parallel.remat": "dots",
                                                      "task.batch": 2, "task.seq_len": 16, **over})
    tokens = np.random.default_rng(0).integers(1, 64, (2, 16), dtype=np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "mask": np.ones((2, 16), np.float32)}
    runs = {}
    for form in ("unrolled", "scan"):
        if form == "scan":
            monkeypatch.setattr(interpret, "_unrolls_stacked", lambda *args: False)
        program._PROGRAMS.clear()
        prog = tessera.compile(exp)
        state = prog.init_train_state(prog.init(0))
        scans = str(jax.make_jaxpr(prog.train_step_fn())(state, batch)).count(" scan[")
        metrics = []
        for _ in range(2):
            state, m = prog.train_step(state, batch)
            metrics.append({k: float(v) for k, v in m.items() if np.ndim(v) == 0})
        runs[form] = scans, metrics, {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(state)}
    monkeypatch.undo()
    program._PROGRAMS.clear()
    assert runs["unrolled"][0] == runs["scan"][0] - 2  # the layers' and its transpose (MoE routing has its own)
    assert runs["unrolled"][1] == runs["scan"][1]
    assert any("amax_history" in path for path in runs["scan"][2]) == ("fp8" in str(over))
    for path, want in runs["scan"][2].items():
        np.testing.assert_allclose(np.asarray(runs["unrolled"][2][path], np.float32), np.asarray(want, np.float32),
                                   rtol=1e-6, atol=1e-5, err_msg=path)  # Adam's steps ~1e-3
