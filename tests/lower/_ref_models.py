"""Test-only GPT-OSS and Llama forward passes composed from the reference ops, over loaded HF weights.

This proves the pieces and the loader against Hugging Face's logits; the real program is built
from the Graph IR by `tessera.compile`. Hyper-parameters that are not model.args (RoPE, eps,
sliding pattern) are read from the fixture's config.json.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tessera.lower.reference import rope as rope_ops
from tessera.lower.reference.activations import swiglu
from tessera.lower.reference.attention import attention
from tessera.lower.reference.linear import embed, linear, project_out, unembed
from tessera.lower.reference.moe import moe, moe_dense
from tessera.lower.reference.norms import rms_norm


def rope_from_config(config: dict) -> tuple[np.ndarray, float]:
    """inv_freq [hd/2] and cos/sin scaling for an HF config's rope_parameters."""
    rp = config["rope_parameters"]
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kind = rp.get("rope_type", "default")
    if kind == "yarn":
        return rope_ops.yarn_inv_freq(head_dim=hd, theta=rp["rope_theta"], factor=rp["factor"],
                                      original=rp["original_max_position_embeddings"],
                                      beta_fast=rp.get("beta_fast", 32.0), beta_slow=rp.get("beta_slow", 1.0),
                                      truncate=rp.get("truncate", True))
    if kind == "llama3":
        return rope_ops.llama3_inv_freq(head_dim=hd, theta=rp["rope_theta"], factor=rp["factor"],
                                        original=rp["original_max_position_embeddings"],
                                        low_freq_factor=rp["low_freq_factor"],
                                        high_freq_factor=rp["high_freq_factor"]), 1.0
    assert kind == "default", kind
    return rope_ops.rope_inv_freq(head_dim=hd, theta=rp["rope_theta"]), 1.0


def attention_block(p: dict, i: int, x, cos, sin, *, eps: float, window: int | None):
    """Pre-norm attention sub-block of layer i: x [B, S, D] -> x + o(attn(rope(q), rope(k), v))."""
    h = rms_norm(x, scale=p["layers/attn_norm/scale"][i], eps=eps)
    bias = lambda name: p[f"layers/attention/{name}_bias"][i] if f"layers/attention/{name}_bias" in p else None
    q = linear(h, weight=p["layers/attention/q"][i], bias=bias("q"))  # [B, S, H, hd]
    k = linear(h, weight=p["layers/attention/k"][i], bias=bias("k"))  # [B, S, KV, hd]
    v = linear(h, weight=p["layers/attention/v"][i], bias=bias("v"))
    q, k = rope_ops.apply_rope(q, cos=cos, sin=sin), rope_ops.apply_rope(k, cos=cos, sin=sin)
    sinks = p["layers/attention/sinks"][i] if "layers/attention/sinks" in p else None
    o = attention(q, k, v, sinks=sinks, causal=True, window=window)
    return x + project_out(o, weight=p["layers/attention/o"][i], bias=bias("o"))


def moe_block(p: dict, i: int, x, *, eps: float, top_k: int, dense: bool = False):
    """Pre-norm MoE sub-block of layer i: x [B, S, D] -> x + moe(norm(x))."""
    b, s, d = x.shape
    h = rms_norm(x, scale=p["layers/mlp_norm/scale"][i], eps=eps).reshape(b * s, d)
    experts = {n: p[f"layers/moe/experts/{n}"][i] for n in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")}
    y = (moe_dense if dense else moe)(h, router=p["layers/moe/router"][i], router_bias=p["layers/moe/router_bias"][i],
                                      top_k=top_k, **experts)
    return x + y.reshape(b, s, d)


def _cos_sin(config: dict, s: int):
    inv_freq, scaling = rope_from_config(config)
    return rope_ops.rope_cos_sin(jnp.arange(s)[None], inv_freq=inv_freq, scaling=scaling)  # [1, S, hd/2] each


def gpt_oss_forward(p: dict, tokens, config: dict, *, dense_moe: bool = False):
    """Logits [B, S, V] of HF GptOssForCausalLM for tokens [B, S]."""
    cos, sin = _cos_sin(config, tokens.shape[1])
    eps = config["rms_norm_eps"]
    x = embed(tokens, table=p["embed/table"])
    for i, kind in enumerate(config["layer_types"]):
        window = config["sliding_window"] if kind == "sliding_attention" else None
        x = attention_block(p, i, x, cos, sin, eps=eps, window=window)
        x = moe_block(p, i, x, eps=eps, top_k=config["num_experts_per_tok"], dense=dense_moe)
    return unembed(rms_norm(x, scale=p["final_norm/scale"], eps=eps), weight=p["unembed/weight"])


def llama_forward(p: dict, tokens, config: dict):
    """Logits [B, S, V] of HF LlamaForCausalLM for tokens [B, S]."""
    cos, sin = _cos_sin(config, tokens.shape[1])
    eps = config["rms_norm_eps"]
    x = embed(tokens, table=p["embed/table"])
    for i in range(config["num_hidden_layers"]):
        x = attention_block(p, i, x, cos, sin, eps=eps, window=None)
        h = rms_norm(x, scale=p["layers/mlp_norm/scale"][i], eps=eps)
        g, u = linear(h, weight=p["layers/mlp/gate"][i]), linear(h, weight=p["layers/mlp/up"][i])
        x = x + linear(swiglu(g, u), weight=p["layers/mlp/down"][i])
    x = rms_norm(x, scale=p["final_norm/scale"], eps=eps)
    if "unembed/weight" in p:
        return unembed(x, weight=p["unembed/weight"])
    return unembed(x, table=p["embed/table"])


FORWARD = {"gpt_oss": gpt_oss_forward, "llama": llama_forward}


def greedy(forward, p: dict, prompt, config: dict, new_tokens: int):
    """Greedy decoding by full recomputation (no cache): prompt [B, P] -> [B, P + new_tokens].

    The sequence lives in a fixed [B, P + N] buffer so one compilation serves every step; causality
    keeps the not-yet-written tail from influencing position t.
    """
    b, plen = prompt.shape
    step = jax.jit(lambda p, buf, t: jnp.argmax(forward(p, buf, config)[:, t - 1], axis=-1).astype(buf.dtype))
    buf = jnp.zeros((b, plen + new_tokens), jnp.int32).at[:, :plen].set(jnp.asarray(prompt, jnp.int32))
    for t in range(plen, plen + new_tokens):
        buf = buf.at[:, t].set(step(p, buf, t))
    return buf
