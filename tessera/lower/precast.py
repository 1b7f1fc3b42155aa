"""Casts of parameters that can be made once, before a loop that would otherwise repeat them.

Deterministic mode computes each canonical shard's gradients in a loop over the shards (shard/deterministic.py).
A parameter held in fp32 and computed in bf16 is cast where its op lowers (`w.astype(x.dtype)`), inside that loop:
on a Llama-1B step with 8 shards on one H100 the casts of the weights took about 45 ms of 441. This module finds,
in the jaxpr of one shard's loss, the parameters whose every use is one such narrowing cast, so the caller can
cast them once and hand the loop the narrow copies.

The result is exact, not an approximation. The transpose of a cast is the cast back, so a parameter's gradient
is the narrow copy's gradient widened, bit for bit, provided the narrow value reaches the loss through a single
cast site. Two sites (a tied embedding's lookup and unembedding cast apart), a use of the wide value, a use
inside a loop body that runs more than once (a weight-shared recurrence: its iterations' cotangents add up in the
wide type), or a use the analysis cannot see through (a custom derivative rule other than `fenced`'s, whose VJP is
the wrapped function's own) keep the parameter as it is.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from tessera.lower.fence import is_fence

# ops through which a value flows unchanged in number and order of its elements' uses: their transposes move
# cotangents without adding any up, so a cast after them may move before them
_TRANSPARENT = frozenset({"reshape", "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice", "copy",
                          "copy_p"})
# call-like ops that run their body once, with operands bound one to one to the body's inputs
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr", "remat2": "jaxpr",
          "checkpoint": "jaxpr"}
_NARROW = (jnp.bfloat16, jnp.float16)


def _body(jaxpr) -> jcore.Jaxpr:
    return jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr


def _scanned_from(eqn) -> int:
    """The index of a scan's first scanned operand (after its constants and carry); past the end if unknown."""
    p = eqn.params
    if "num_consts" in p:  # jax 0.10
        return p["num_consts"] + p["num_carry"]
    if "ft_in" in p:  # jax 0.11: the operands as a flat tree of (consts, carry, xs)
        consts, carry, _ = p["ft_in"].unpack()
        return len(consts) + len(carry)
    return len(eqn.invars)


def _box(eqn):
    """The region a static `slice` reads, as ((start, limit), ...) per dim (strided slices: None)."""
    if eqn.primitive.name != "slice":
        return None
    if eqn.params.get("strides") not in (None, (1,) * len(eqn.params["start_indices"])):
        return None
    return tuple(zip(eqn.params["start_indices"], eqn.params["limit_indices"]))


def _disjoint(a, b) -> bool:
    return any(hi_a <= lo_b or hi_b <= lo_a for (lo_a, hi_a), (lo_b, hi_b) in zip(a, b))


def _sites(jaxpr: jcore.Jaxpr, var) -> list | None:
    """The narrowing casts `var`'s value reaches, their dtypes, or None if the value has any other use, or reaches
    two casts whose cotangents would meet (add up) before the value does. Uses may be several only as static
    slices of disjoint regions (a scan body reading two layers of a stacked weight): their cotangents land on
    different elements."""
    if any(v is var for v in jaxpr.outvars):
        return None
    uses = [(eqn, i) for eqn in jaxpr.eqns for i, v in enumerate(eqn.invars) if v is var]
    if len(uses) > 1:
        boxes = [_box(eqn) for eqn, _ in uses]
        if any(b is None for b in boxes) or not all(_disjoint(a, b) for j, a in enumerate(boxes)
                                                    for b in boxes[j + 1:]):
            return None
    found = []
    for eqn, i in uses:
        name = eqn.primitive.name
        if name == "convert_element_type":
            dtype = eqn.params["new_dtype"]
            if var.aval.dtype != jnp.float32 or dtype not in _NARROW:
                return None
            found.append(jnp.dtype(dtype))
            continue
        if name in _TRANSPARENT and i == 0:
            inner = _sites(jaxpr, eqn.outvars[0])
        elif is_fence(eqn) or name in _CALLS and _CALLS[name] in eqn.params:
            body = _body(eqn.params["call_jaxpr" if name == "custom_vjp_call" else _CALLS[name]])
            inner = _sites(body, body.invars[i])
        elif name == "optimization_barrier":
            inner = _sites(jaxpr, eqn.outvars[i])
        elif name == "cond" and i > 0:  # one branch runs: its cotangent is selected, never added to another's
            per = [_sites(_body(b), _body(b).invars[i - 1]) for b in eqn.params["branches"]]
            inner = None if any(x is None for x in per) else [d for x in per for d in x]
        elif name == "scan" and i >= _scanned_from(eqn):
            body = _body(eqn.params["jaxpr"])  # a scanned operand: each iteration reads its own slice once
            inner = _sites(body, body.invars[i])
        else:
            return None
        if not inner:
            return None
        found += inner
    return found


def hoistable(fn: Callable, params: dict, *args: Any) -> dict[str, Any]:
    """{path: dtype} of the fp32 parameters whose only use in `fn(params, *args)` is one cast to bf16 or fp16 (of
    each disjoint slice, where a loop body reads several layers of a stacked weight).

    `params` and `args` may be arrays or ShapeDtypeStructs; `fn` is traced, not run. Feeding `fn` the parameters
    cast to these dtypes computes the same values, and the gradients with respect to the cast copies, widened,
    are those with respect to the parameters, bit for bit."""
    pairs, tree = jax.tree_util.tree_flatten_with_path(params)
    leaves = [leaf for _, leaf in pairs]
    closed = jax.make_jaxpr(lambda flat, *a: fn(jax.tree.unflatten(tree, flat), *a))(leaves, *args)
    out = {}
    for (key, _), var in zip(pairs, closed.jaxpr.invars[:len(leaves)]):
        path = jax.tree_util.keystr(key, simple=True, separator="/")
        if path not in params:  # a parameter held as several arrays (packed types): left as it is
            continue
        sites = _sites(closed.jaxpr, var)
        if sites and len(set(sites)) == 1:
            out[path] = sites[0]
    return out


def cast(params: dict, dtypes: dict[str, Any]) -> dict:
    """params with those named in `dtypes` cast to them (the narrow copies `hoistable` allows)."""
    return {k: v.astype(dtypes[k]) if k in dtypes else v for k, v in params.items()}
