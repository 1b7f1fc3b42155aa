"""Reference lowerings of the primitive ops (tessera/ir/ops_core.py): one function per op, one line to register.

Each returns its results in the element types the IR gives them; softmax statistics are computed in fp32,
contractions and the `sum` reduction accumulate in the context's accumulation type (reference/accum.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.context import jnp_dtype
from tessera.lower.named import align, einsum, move_last, names, stored_dtype
from tessera.lower.reference import accum as accum_ref, activations
from tessera.lower.reference.attention import attention_mask
from tessera.lower.reference.losses import cross_entropy, token_cross_entropy
from tessera.lower.table import lowers


def _out(op, x, i: int = 0):
    """x cast to the element type of result i."""
    return x.astype(jnp_dtype(op.results[i].type.dtype))


def _binary(fn):
    def lower(ctx, op, attrs, ins, params):
        a, b = op.values
        want = names(op.results[0])
        x = align(ins[0], names(a), want)
        y = align(ins[1], names(b), want)
        return [_out(op, fn(x, y))]

    return lower


for _name, _fn in [("add", jnp.add), ("sub", jnp.subtract), ("mul", jnp.multiply), ("div", jnp.divide),
                   ("maximum", jnp.maximum)]:
    lowers(_name)(_binary(_fn))


def _unary(fn):
    def lower(ctx, op, attrs, ins, params):
        return [_out(op, fn(ins[0]))]

    return lower


for _name, _fn in [("silu", activations.silu), ("sigmoid", jax.nn.sigmoid), ("exp", jnp.exp),
                   ("neg", jnp.negative), ("tanh", jnp.tanh), ("sin", jnp.sin), ("cos", jnp.cos),
                   ("square", jnp.square), ("stop_gradient", jax.lax.stop_gradient), ("softplus", jax.nn.softplus)]:
    lowers(_name)(_unary(_fn))


@lowers("gelu")
def _gelu(ctx, op, attrs, ins, params):
    return [_out(op, activations.gelu(ins[0], approximate=attrs["approximate"]))]


@lowers("scale")
def _scale(ctx, op, attrs, ins, params):
    return [_out(op, ins[0] * jnp.asarray(attrs["by"], ins[0].dtype))]


@lowers("dot")
def _dot(ctx, op, attrs, ins, params):
    a, b = op.values
    store = stored_dtype(jnp_dtype(op.results[0].type.dtype), ctx.accum_dtype)
    return [_out(op, einsum([names(a), names(b)], names(op.results[0]), *ins, accum=ctx.accum_dtype,
                            store=store))]


@lowers("sum")
def _sum(ctx, op, attrs, ins, params):
    have = names(op.values[0])
    axes = tuple(have.index(d.name) for d in attrs["over"])
    if accum_ref.narrow(ctx.accum_dtype) and jnp.issubdtype(ins[0].dtype, jnp.floating):
        return [_out(op, accum_ref.sum(ins[0], axes, accum=ctx.accum_dtype))]
    x = ins[0].astype(jnp.promote_types(ins[0].dtype, jnp.float32))  # fp32 or wider (f64); complex keeps its parts
    return [_out(op, jnp.sum(x, axis=axes))]


@lowers("softmax")
def _softmax(ctx, op, attrs, ins, params):
    have, dim = names(op.values[0]), attrs["dim"].name
    x, moved = move_last(ins[0].astype(jnp.float32), have, dim)
    m = jnp.max(x, axis=-1, keepdims=True)
    if len(ins) == 2:  # the sink joins the denominator only
        sink = align(ins[1].astype(jnp.float32), names(op.values[1]), moved[:-1])[..., None]
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(x - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    if len(ins) == 2:
        denom = denom + jnp.exp(sink - m)
    p = e / denom
    return [_out(op, jnp.moveaxis(p, -1, have.index(dim)))]


@lowers("mask")
def _mask(ctx, op, attrs, ins, params):
    have = names(op.values[0])
    qn, kn = attrs["q"].name, attrs["k"].name
    s, t = ins[0].shape[have.index(qn)], ins[0].shape[have.index(kn)]
    visible = attention_mask(s, t, causal=attrs["causal"], window=attrs["window"])[0]  # [S, T]
    visible = align(visible, (qn, kn), have)
    return [jnp.where(visible, ins[0], jnp.asarray(-jnp.inf, ins[0].dtype))]


@lowers("rename")
def _rename(ctx, op, attrs, ins, params):
    return [ins[0]]


@lowers("repeat_kv")
def _repeat_kv(ctx, op, attrs, ins, params):
    have = names(op.values[0])
    axis = have.index("kv_heads")
    group = attrs["heads"] // ins[0].shape[axis]
    return [jnp.repeat(ins[0], group, axis=axis)]


@lowers("transpose")
def _transpose(ctx, op, attrs, ins, params):
    return [align(ins[0], names(op.values[0]), tuple(d.name for d in attrs["to"]))]


@lowers("reshape")
def _reshape(ctx, op, attrs, ins, params):
    have, x = names(op.values[0]), ins[0]
    first = have.index(attrs["from"][0].name)
    last = have.index(attrs["from"][-1].name)
    shape = x.shape[:first] + tuple(d.size for d in attrs["to"]) + x.shape[last + 1:]
    return [x.reshape(shape)]


@lowers("top_k")
def _top_k(ctx, op, attrs, ins, params):
    have, dim = names(op.values[0]), attrs["dim"].name
    x, _ = move_last(ins[0], have, dim)
    vals, idx = jax.lax.top_k(x, attrs["k"])
    axis = have.index(dim)
    return [_out(op, jnp.moveaxis(vals, -1, axis)), jnp.moveaxis(idx.astype(jnp.int32), -1, axis)]


@lowers("scatter")
def _scatter(ctx, op, attrs, ins, params):
    have = names(op.values[0])
    vals, _ = move_last(ins[0], have, "top_k")
    idx, _ = move_last(ins[1], have, "top_k")
    onehot = jax.nn.one_hot(idx, attrs["size"], dtype=vals.dtype)  # [..., k, size]
    dense = jnp.einsum("...k,...ks->...s", vals, onehot)
    return [_out(op, jnp.moveaxis(dense, -1, have.index("top_k")))]


@lowers("cross_entropy")
def _cross_entropy(ctx, op, attrs, ins, params):
    logits, labels = op.values
    have = names(logits)
    x, moved = move_last(ins[0], have, attrs["dim"].name)
    y = align(ins[1], names(labels), moved[:-1])
    return [cross_entropy(x, y)]


@lowers("token_cross_entropy")
def _token_cross_entropy(ctx, op, attrs, ins, params):
    logits, labels = op.values
    x, moved = move_last(ins[0], names(logits), attrs["dim"].name)
    y = align(ins[1], names(labels), moved[:-1])
    return [align(token_cross_entropy(x, y), moved[:-1], names(op.results[0]))]


@lowers("exact_match")
def _exact_match(ctx, op, attrs, ins, params):
    logits, labels = op.values
    x, moved = move_last(ins[0], names(logits), attrs["dim"].name)
    right = jnp.argmax(x, axis=-1) == align(ins[1], names(labels), moved[:-1])
    over = tuple(moved.index(d.name) for d in attrs["over"])
    right = jnp.all(right, axis=over)
    kept = [n for n in moved[:-1] if n not in {d.name for d in attrs["over"]}]
    return [align(jax.lax.stop_gradient(right.astype(jnp.float32)), kept, names(op.results[0]))]


@lowers("take")
def _take(ctx, op, attrs, ins, params):
    return [jnp.take(ins[0], attrs["index"], axis=names(op.values[0]).index(attrs["dim"].name))]


@lowers("basis")
def _basis(ctx, op, attrs, ins, params):
    x = ins[0]
    axis = names(op.values[0]).index(attrs["dim"].name)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    unit = (jnp.arange(x.shape[axis]) == attrs["index"]).astype(x.dtype).reshape(shape)
    return [jnp.broadcast_to(unit, x.shape)]


@lowers("mean")
def _mean(ctx, op, attrs, ins, params):
    have = names(op.values[0])
    axes = tuple(have.index(d.name) for d in attrs["over"])
    return [_out(op, jnp.mean(ins[0].astype(jnp.promote_types(ins[0].dtype, jnp.float32)), axis=axes))]


@lowers("stack")
def _stack(ctx, op, attrs, ins, params):
    return [_out(op, jnp.stack(ins, axis=-1))]
