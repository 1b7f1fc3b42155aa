"""The Hugging Face tensor ↔ Tessera parameter table, one rule a line (docs/contracts.md lays out both sides).

A rule names an HF tensor (`{i}` = layer index; those parameters are stacked on a leading `layers`
axis), the Tessera path(s) it feeds, the HF shape as dimension expressions over the model's sizes,
and a layout transform: `load` turns the HF array into the Tessera array(s), `save` is its inverse.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, NamedTuple

import numpy as np


class Transform(NamedTuple):
    """A layout change: load(hf, dims) -> tuple of Tessera arrays; save(tuple, dims) -> hf array."""

    load: Callable[[np.ndarray, dict], tuple[np.ndarray, ...]]
    save: Callable[[tuple[np.ndarray, ...], dict], np.ndarray]


def _heads_in(n: str) -> Transform:
    # nn.Linear [n*hd, D] <-> [D, n, hd]
    return Transform(lambda w, d: (w.T.reshape(d["D"], d[n], d["hd"]),),
                     lambda ws, d: ws[0].reshape(d["D"], d[n] * d["hd"]).T)


def _heads_bias(n: str) -> Transform:
    # [n*hd] <-> [n, hd]
    return Transform(lambda b, d: (b.reshape(d[n], d["hd"]),), lambda bs, d: bs[0].reshape(-1))


IDENTITY = Transform(lambda w, d: (w,), lambda ws, d: ws[0])
TRANSPOSE = Transform(lambda w, d: (w.T,), lambda ws, d: ws[0].T)  # nn.Linear [out, in] <-> [in, out]
HEADS_OUT = Transform(lambda w, d: (w.T.reshape(d["H"], d["hd"], d["D"]),),  # [D, H*hd] <-> [H, hd, D]
                      lambda ws, d: ws[0].reshape(d["H"] * d["hd"], d["D"]).T)
# GPT-OSS fuses gate and up along the last axis, interleaved: gate = [..., 0::2], up = [..., 1::2]
DEINTERLEAVE = Transform(lambda w, d: (w[..., 0::2], w[..., 1::2]),
                         lambda ws, d: np.stack(ws, axis=-1).reshape(ws[0].shape[:-1] + (-1,)))


@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF tensor and the Tessera parameter(s) it holds."""

    hf: str  # "model.layers.{i}.self_attn.q_proj.weight"
    paths: tuple[str, ...]  # ("layers/attention/q",)
    shape: str  # HF shape as dimension expressions: "H*hd D"
    transform: Transform = IDENTITY
    mxfp4: bool = False  # HF may store it as an MXFP4 `_blocks`/`_scales` pair (transform acts on `out` only)

    @property
    def per_layer(self) -> bool:
        """Whether the tensor exists once per layer (and the parameters are stacked)."""
        return "{i}" in self.hf

    def hf_shape(self, dims: dict) -> tuple[int, ...]:
        """The HF tensor's shape for these model sizes."""
        return tuple(math.prod(int(f) if f.isdigit() else dims[f] for f in e.split("*")) for e in self.shape.split())


def _r(hf: str, paths: str, shape: str, transform: Transform = IDENTITY, mxfp4: bool = False) -> Rule:
    return Rule(hf, tuple(paths.split()), shape, transform, mxfp4)


_L = "model.layers.{i}."
_ATTN_NORMS = (
    _r(_L + "input_layernorm.weight", "layers/attn_norm/scale", "D"),
    _r(_L + "post_attention_layernorm.weight", "layers/mlp_norm/scale", "D"),
    _r(_L + "self_attn.q_proj.weight", "layers/attention/q", "H*hd D", _heads_in("H")),
    _r(_L + "self_attn.k_proj.weight", "layers/attention/k", "KV*hd D", _heads_in("KV")),
    _r(_L + "self_attn.v_proj.weight", "layers/attention/v", "KV*hd D", _heads_in("KV")),
    _r(_L + "self_attn.o_proj.weight", "layers/attention/o", "D H*hd", HEADS_OUT),
)
_ENDS = (
    _r("model.embed_tokens.weight", "embed/table", "V D"),
    _r("model.norm.weight", "final_norm/scale", "D"),
)
_UNEMBED = _r("lm_head.weight", "unembed/weight", "V D", TRANSPOSE)

GPT_OSS_RULES: tuple[Rule, ...] = _ENDS + (_UNEMBED,) + _ATTN_NORMS + (
    _r(_L + "self_attn.q_proj.bias", "layers/attention/q_bias", "H*hd", _heads_bias("H")),
    _r(_L + "self_attn.k_proj.bias", "layers/attention/k_bias", "KV*hd", _heads_bias("KV")),
    _r(_L + "self_attn.v_proj.bias", "layers/attention/v_bias", "KV*hd", _heads_bias("KV")),
    _r(_L + "self_attn.o_proj.bias", "layers/attention/o_bias", "D"),
    _r(_L + "self_attn.sinks", "layers/attention/sinks", "H"),
    _r(_L + "mlp.router.weight", "layers/moe/router", "E D", TRANSPOSE),
    _r(_L + "mlp.router.bias", "layers/moe/router_bias", "E"),
    _r(_L + "mlp.experts.gate_up_proj", "layers/moe/experts/gate layers/moe/experts/up", "E D 2*F", DEINTERLEAVE,
       mxfp4=True),
    _r(_L + "mlp.experts.gate_up_proj_bias", "layers/moe/experts/gate_bias layers/moe/experts/up_bias", "E 2*F",
       DEINTERLEAVE),
    _r(_L + "mlp.experts.down_proj", "layers/moe/experts/down", "E F D", mxfp4=True),
    _r(_L + "mlp.experts.down_proj_bias", "layers/moe/experts/down_bias", "E D"),
)

LLAMA_RULES: tuple[Rule, ...] = _ENDS + _ATTN_NORMS + (
    _r(_L + "mlp.gate_proj.weight", "layers/mlp/gate", "F D", TRANSPOSE),
    _r(_L + "mlp.up_proj.weight", "layers/mlp/up", "F D", TRANSPOSE),
    _r(_L + "mlp.down_proj.weight", "layers/mlp/down", "D F", TRANSPOSE),
)
LLAMA_UNTIED_RULES = LLAMA_RULES + (_UNEMBED,)

# What an MXFP4 GPT-OSS checkpoint's quantization_config leaves dense (everything but the experts).
MXFP4_NOT_CONVERTED = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")

# Tensors some checkpoints carry that hold no parameter (non-persistent buffers saved by old versions).
IGNORED = (re.compile(r"\.rotary_emb\.inv_freq$"),)


def expand(rule: Rule, layers: int) -> list[str]:
    """The concrete HF names of a rule: one, or one per layer."""
    return [rule.hf.format(i=i) for i in range(layers)] if rule.per_layer else [rule.hf]
