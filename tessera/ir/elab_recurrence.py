"""Elaboration of recurrences: `repeat` and `loop` (tessera/ir/ops_recurrence.py says what they compute).

    x = repeat(layers, layer, x) as layers                          # stacked params, one scan
    h = repeat(n, step, h, x, shared = true, grad = last) as cell   # one set of params; the one-step gradient
    h = loop(step, h, x, until = halt, max = 16) as cell            # until `halt` is > 0, at most 16 steps

The block is elaborated once into the op's region, on fresh arguments typed like the carried tensors; it must
return what it takes. Its params are named under the call's scope (`cell/...`), a loop's halting block's under
the scope and its own name (`cell/halt/...`). A stacked repeat's params gain a leading axis, named apart from
the axes of the repeats around it (`layers`, `layers1`); a weight-shared repeat's and a loop's gain none.
"""

from __future__ import annotations

from tessera.diagnostics import did_you_mean
from tessera.grammar import model_ast as A
from tessera.ir.elab_calls import _check_ann, _scope, _tensor
from tessera.ir.elaborate import Elaborator, LayerIndex, Tensor, _Frame, _kind
from tessera.ir.ops_recurrence import GRADS, check_predicate
from tessera.ir.registry import OpError
from tessera.ir.types import DimName, Op, Region, TensorType, Value


def _block(el: Elaborator, e: A.Call, name: A.Expr, frame: _Frame, usage: str, verb: str) -> A.Block:
    if not isinstance(name, A.Name):
        raise el.error(usage, name.span)
    block = el.model.blocks.get(name.id)
    if block is None:
        raise el.error(f"unknown block `{name.id}`", name.span, hint=did_you_mean(name.id, el.model.blocks))
    if name.id in frame.stack:
        raise el.error(f"block `{name.id}` {verb} itself ({' → '.join(frame.stack + (name.id,))})", e.span)
    return block


def _grad(el: Elaborator, k: A.Kwarg | None) -> str:
    """`grad = all | last` (a bare word, or a string)."""
    if k is None:
        return "all"
    word = k.value.id if isinstance(k.value, A.Name) else getattr(k.value, "value", None)
    if word not in GRADS:
        raise el.error("`grad` is `all` (every step's gradient, the default) or `last` (the one-step gradient: "
                       "the last step's only)", k.value.span)
    return word


def _options(el: Elaborator, e: A.Call, allowed: tuple[str, ...]) -> dict[str, A.Kwarg]:
    opts = {}
    for k in e.kwargs:
        if k.name not in allowed:
            raise el.error(f"`{e.func}` has no argument `{k.name}` (arguments: {', '.join(allowed)})", k.span,
                           hint=did_you_mean(k.name, allowed))
        opts[k.name] = k
    return opts


def _bind(el: Elaborator, where, block: A.Block, carried: list, exprs, with_index: bool):
    """The region's arguments, typed like the carried tensors, the block's environment and its index parameter
    (a repeated block may take the iteration index)."""
    tensor_params = [p for p in block.params if isinstance(p.ann, A.TensorAnn)]
    index_params = [p for p in block.params if not isinstance(p.ann, A.TensorAnn)]
    if len(tensor_params) != len(carried) or len(index_params) > int(with_index):
        extra = " and at most one layer index" if with_index else " (and no iteration index)"
        raise el.error(f"block `{block.name}` must take {len(carried)} tensor(s){extra} to carry "
                       f"{len(carried)} value(s)", where)
    args = [Value(c.type, p.name) for c, p in zip(carried, tensor_params)]
    benv = dict(el.globals)
    for p, v, a in zip(tensor_params, args, exprs):
        _check_ann(el, p, v.type, a.span, block.name)
        benv[p.name] = v
    return args, benv, index_params


def _returns(el: Elaborator, block: A.Block, outs: list, args: list[Value], verb: str) -> None:
    """The block returns what it takes: the error points at the returned value whose type changed."""
    ret = next((s for s in block.body if isinstance(s, A.Return)), None)
    if len(outs) != len(args):
        raise el.error(f"block `{block.name}` returns {len(outs)} value(s) but carries {len(args)}",
                       ret.span if ret else block.span)
    for k, (o, a) in enumerate(zip(outs, args)):
        if not isinstance(o, Tensor) or o.type != a.type:
            raise el.error(f"block `{block.name}` is {verb}, so it must return what it takes: value {k} should be "
                           f"{a.type}, got {_kind(o)}", ret.values[k].span if ret else block.span)


def repeat(el: Elaborator, e: A.Call, env: dict, frame: _Frame):
    """`repeat(n, block, x..., shared = false, grad = all)`: one `repeat` op."""
    usage = "write repeat(n, block, x, ...): a count, a block name, then the carried tensors"
    if len(e.args) < 3 or not isinstance(e.args[1], A.Name):
        raise el.error(usage, e.span)
    opts = _options(el, e, ("shared", "grad"))
    shared = el.eval(opts["shared"].value, env) if "shared" in opts else False
    if not isinstance(shared, bool):
        raise el.error(f"`shared` is true or false, got {_kind(shared)}", opts["shared"].value.span)
    grad = _grad(el, opts.get("grad"))
    if grad == "last" and not shared:
        raise el.error("`grad = last` needs `shared = true`: the one-step gradient of a stacked repeat would leave "
                       "its other layers without one", opts["grad"].span)
    n = el.size(e.args[0], env, "repeat count")
    block = _block(el, e, e.args[1], frame, usage, "repeats")
    carried = [_tensor(el, el.eval(a, env, frame), a) for a in e.args[2:]]
    args, benv, index_params = _bind(el, e.span, block, carried, e.args[2:], with_index=True)
    index = Value(TensorType("i32", ()), index_params[0].name if index_params else "i")
    if index_params:
        benv[index_params[0].name] = LayerIndex(index, n)
    taken = {a for a, _ in frame.axes}
    axis = None if shared else next(f"layers{k}" if k else "layers" for k in range(len(taken) + 1)
                                    if (f"layers{k}" if k else "layers") not in taken)
    scope = _scope(frame, e, block.name)
    inner = _Frame(Region([index] + args, [], []), scope, frame.axes + (() if shared else ((axis, n),)),
                   frame.stack + (block.name,), root=scope, shares=frame.shares)
    outs = el.exec_body(block, benv, inner)
    _returns(el, block, outs, args, "repeated")
    inner.region.outputs = [el.as_value(o, inner) for o in outs]
    results = [Value(a.type) for a in args]
    attrs = {"n": n, "axis": None if shared else DimName(axis), "grad": grad}
    frame.region.ops.append(Op("repeat", [el.as_value(c, frame) for c in carried], attrs, results, inner.region,
                               e.span))
    return results[0] if len(results) == 1 else tuple(results)


def loop(el: Elaborator, e: A.Call, env: dict, frame: _Frame):
    """`loop(block, x..., until = halt, max = N, grad = all)`: one `loop` op holding the block and the halting
    block as its two regions."""
    usage = "write loop(block, x, ..., until = halt, max = 16): a block, the carried tensors, a halting block, a cap"
    if len(e.args) < 2 or not isinstance(e.args[0], A.Name):
        raise el.error(usage, e.span)
    opts = _options(el, e, ("until", "max", "grad"))
    if "max" not in opts:
        raise el.error("a loop needs a cap on its iterations: add `max = N` (at most N steps; FLOPs count N)", e.span)
    if "until" not in opts:
        raise el.error("a loop needs a halting block: add `until = halt`, a block of the carried tensors returning "
                       "a predicate (halted where > 0)", e.span,
                       hint="for a fixed number of steps write repeat(n, block, x, shared = true)")
    cap = el.size(opts["max"].value, env, "loop cap `max`")
    grad = _grad(el, opts.get("grad"))
    block = _block(el, e, e.args[0], frame, usage, "loops")
    halt = _block(el, e, opts["until"].value, frame, "`until` names a block: until = halt", "loops")
    carried = [_tensor(el, el.eval(a, env, frame), a) for a in e.args[1:]]
    args, benv, _ = _bind(el, e.span, block, carried, e.args[1:], with_index=False)
    scope = _scope(frame, e, block.name)
    inner = _Frame(Region(args, [], []), scope, frame.axes, frame.stack + (block.name,), scope, frame.shares)
    outs = el.exec_body(block, benv, inner)
    _returns(el, block, outs, args, "looped")
    inner.region.outputs = [el.as_value(o, inner) for o in outs]

    cargs, cenv, _ = _bind(el, opts["until"].value.span, halt, carried, e.args[1:], with_index=False)
    cond = _Frame(Region(cargs, [], []), scope + (halt.name,), frame.axes, frame.stack + (halt.name,), scope,
                  frame.shares)
    pred = el.exec_body(halt, cenv, cond)
    ret = next(s for s in halt.body if isinstance(s, A.Return))
    try:
        if len(pred) != 1 or not isinstance(pred[0], Tensor):
            raise OpError(f"returns one halting predicate, got {', '.join(_kind(p) for p in pred)}")
        check_predicate(pred[0].type, [a.type for a in args])
    except OpError as exc:
        raise el.error(f"halting block `{halt.name}`: {exc}", ret.values[0].span) from None
    cond.region.outputs = [el.as_value(pred[0], cond)]
    results = [Value(a.type) for a in args]
    frame.region.ops.append(Op("loop", [el.as_value(c, frame) for c in carried], {"max": cap, "grad": grad},
                               results, inner.region, e.span, second=cond.region))
    return results[0] if len(results) == 1 else tuple(results)
