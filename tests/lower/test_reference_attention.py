"""Attention with sinks and a sliding window, against one GPT-OSS layer captured inside transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from tessera.lower.reference import rope
from tessera.lower.reference.attention import attention
from tessera.lower.reference.linear import linear, project_out

from .conftest import float64, hf_fixture

WINDOW = 4  # the fixture's sliding_window; layer 0 slides, layer 1 attends fully


def _qkv(p, pieces, layer):
    # the layer's q, k, v [B, S, heads, hd] after RoPE, from the captured attention input
    x = jnp.asarray(pieces[f"layer{layer}.attn.in"])
    inv_freq, scaling = rope.yarn_inv_freq(head_dim=16, theta=150000.0, factor=32.0, original=4096, truncate=False)
    cos, sin = rope.rope_cos_sin(jnp.arange(x.shape[1])[None], inv_freq=inv_freq, scaling=scaling)
    out = []
    for name in "qkv":
        y = linear(x, weight=p[f"layers/attention/{name}"][layer], bias=p[f"layers/attention/{name}_bias"][layer])
        out.append(y if name == "v" else rope.apply_rope(y, cos=cos, sin=sin))
    return out


def _core(pieces, layer):
    b, s, _ = pieces[f"layer{layer}.attn.in"].shape
    return pieces[f"layer{layer}.attn.core"].reshape(b, s, -1, 16)  # o_proj input [B, S, H*hd] -> heads


@pytest.mark.parametrize("layer, window", [(0, WINDOW), (1, None)])
def test_attention_layer_matches_transformers(gpt_oss_pieces, gpt_oss_params, layer, window):
    p = gpt_oss_params
    q, k, v = _qkv(p, gpt_oss_pieces, layer)
    o = attention(q, k, v, sinks=p["layers/attention/sinks"][layer], window=window)
    np.testing.assert_allclose(o, _core(gpt_oss_pieces, layer), atol=2e-6)
    out = project_out(o, weight=p["layers/attention/o"][layer], bias=p["layers/attention/o_bias"][layer])
    np.testing.assert_allclose(out, gpt_oss_pieces[f"layer{layer}.attn.out"], atol=5e-6)


def test_fixture_is_longer_than_the_window():
    assert hf_fixture("gpt_oss")["tokens"].shape[1] > 2 * WINDOW


@pytest.mark.parametrize("wrong", [
    dict(window=WINDOW - 1), dict(window=WINDOW + 1), dict(window=None), dict(no_sinks=True)])
def test_off_by_one_window_or_missing_sinks_is_caught(gpt_oss_pieces, gpt_oss_params, wrong):
    p = gpt_oss_params
    q, k, v = _qkv(p, gpt_oss_pieces, 0)
    sinks = None if wrong.get("no_sinks") else p["layers/attention/sinks"][0]
    o = attention(q, k, v, sinks=sinks, window=wrong.get("window", WINDOW))
    assert np.abs(np.asarray(o) - _core(gpt_oss_pieces, 0)).max() > 1e-3


def test_sink_joins_the_denominator_only():
    q = jnp.zeros((1, 1, 1, 4))
    k = jnp.zeros((1, 3, 1, 4))
    v = jnp.arange(12.0).reshape(1, 3, 1, 4)
    # 3 keys with score 0 plus a sink of logit log(3): weights 1/6 each, the sink's 1/2 carries no value
    o = attention(q, k, v, sinks=jnp.array([np.log(3.0)]), causal=False)
    np.testing.assert_allclose(o[0, 0, 0], v[0, :, 0].sum(0) / 6, rtol=1e-6)


def test_attention_gradient_with_sinks_and_window():
    with float64():
        r = np.random.default_rng(0)
        q, k, v = (jnp.asarray(r.standard_normal((1, 6, 4, 8))[:, :, : 4 if n == "q" else 2]) for n in "qkv")
        sinks = jnp.asarray(r.standard_normal(4))
        check_grads(jax.jit(lambda q, k, v, s: attention(q, k, v, sinks=s, window=3)), (q, k, v, sinks),
                    order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("c, prompt", [(8, 5), (8, 8), (8, 13), (8, 16), (6, 3)])
def test_cache_slice_writes_equal_scattered_writes(c, prompt):
    """With the positions known to be one run in every row (LowerCtx.position_start), the ring buffer takes a
    prompt and then decode steps as slices; the cache is the one the per-position scatter writes, wrap-arounds
    included (prompts longer than the cache, decode steps past its end)."""
    from tessera.lower.reference.kv_cache import cache_write as _cache_write

    rng = np.random.default_rng(c * 100 + prompt)
    b, h, d = 2, 3, 4
    empty = {"k": jnp.zeros((b, c, h, d)), "v": jnp.zeros((b, c, h, d)), "pos": jnp.full((b, c), -1, jnp.int32)}
    kv = lambda s: [jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for _ in range(2)]  # noqa: E731
    k, v = kv(prompt)
    pos = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (b, prompt))
    sliced, scattered = _cache_write(empty, k, v, pos, 0), _cache_write(empty, k, v, pos)
    step = jax.jit(lambda cache, k, v, start: _cache_write(cache, k, v, jnp.full((b, 1), start), start))
    for t in range(prompt, prompt + c + 3):  # every slot written again at least once
        k, v = kv(1)
        sliced = step(sliced, k, v, jnp.int32(t))
        scattered = _cache_write(scattered, k, v, jnp.full((b, 1), t, jnp.int32))
        for name in ("k", "v", "pos"):
            np.testing.assert_array_equal(sliced[name], scattered[name], err_msg=f"{name} after position {t}")
    assert int(jnp.max(sliced["pos"])) == prompt + c + 2
