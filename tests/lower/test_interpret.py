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
