"""Elaboration of derivatives (`jvp`, `vjp`, `grad` of a block) and of blocks that declare their own adjoint.

    du = jvp(net, xy, basis(xy, coord, 0))     # d net / dx at every point: [points, field]
    g  = grad(energy, xy)                       # energy returns a scalar: [points, coord]
    ct = vjp(net, xy, w)                        # w^T J: [points, coord]

The block is elaborated once into the op's region, whose arguments are (x, other tensor arguments...). Its
parameters are named as a call of the block at the same place names them (elab_calls.block_scope): by name,
from the innermost repeat's scope (the top level outside one), so `jvp(net, ...)` anywhere, and `grad(energy,
...)` of an `energy` that calls `net`, read the same `@net/...` as a plain `net(xy)` call; with `as`, under
the caller's scope.
"""

from __future__ import annotations

from tessera.diagnostics import did_you_mean
from tessera.grammar import model_ast as A
from tessera.ir.elab_calls import _check_ann, _tensor, block_scope
from tessera.ir.elaborate import Elaborator, Tensor, _Frame, _kind
from tessera.ir.registry import OpError, get_op
from tessera.ir.types import Op, ParamRef, Region, Value

_LEADING = {"jvp": 2, "vjp": 2, "grad": 1}  # tensors before the block's other arguments: (x, v) / (x, ct) / (x)
_USAGE = {"jvp": "jvp(block, x, v, other args...)", "vjp": "vjp(block, x, ct, other args...)",
          "grad": "grad(block, x, other args...)"}


def _block(el: Elaborator, e: A.Call, frame: _Frame, name_expr: A.Expr) -> A.Block:
    if not isinstance(name_expr, A.Name):
        raise el.error(f"write {_USAGE[e.func]}: the first argument names a block", name_expr.span)
    block = el.model.blocks.get(name_expr.id)
    if block is None:
        raise el.error(f"unknown block `{name_expr.id}`", name_expr.span, hint=did_you_mean(name_expr.id, el.model.blocks))
    if name_expr.id in frame.stack:
        raise el.error(f"block `{name_expr.id}` differentiates itself ({' → '.join(frame.stack + (name_expr.id,))})",
                       e.span)
    return block


def _region(el: Elaborator, e: A.Call, block: A.Block, tensors: list, exprs: list, frame: _Frame) -> Region:
    """The block elaborated on fresh arguments typed like `tensors`, under the derivative's scope."""
    if len(block.params) != len(tensors):
        raise el.error(f"block `{block.name}` takes {len(block.params)} argument(s); {e.func} passes it "
                       f"{len(tensors)} (x and the other arguments)", e.span)
    args, benv = [], dict(el.globals)
    for p, t, x in zip(block.params, tensors, exprs):
        if isinstance(p.ann, A.TensorAnn):
            _check_ann(el, p, t.type, x.span, block.name)
        v = Value(t.type, p.name)
        args.append(v)
        benv[p.name] = v
    scope, _ = block_scope(el, frame, e, block.name)
    inner = _Frame(Region(args, [], []), scope, frame.axes, frame.stack + (block.name,), frame.root, shares=True)
    outs = el.exec_body(block, benv, inner)
    if len(outs) != 1 or not isinstance(outs[0], Tensor):
        raise el.error(f"block `{block.name}` must return one tensor to be differentiated, got "
                       f"{', '.join(_kind(o) for o in outs)}", block.span)
    inner.region.outputs = [el.as_value(outs[0], inner)]
    return inner.region


def derivative(el: Elaborator, e: A.Call, env: dict, frame: _Frame):
    """`jvp` / `vjp` / `grad` of a block: one op holding the block's region."""
    lead = _LEADING[e.func]
    if e.kwargs or len(e.args) < 1 + lead:
        raise el.error(f"write {_USAGE[e.func]}", e.span)
    block = _block(el, e, frame, e.args[0])
    exprs = list(e.args[1:])
    values = [_tensor(el, el.eval(a, env, frame), a) for a in exprs]
    primal, primal_exprs = [values[0], *values[lead:]], [exprs[0], *exprs[lead:]]
    region = _region(el, e, block, primal, primal_exprs, frame)
    operands = [el.as_value(v, frame) for v in values]
    op = Op(e.func, operands, {"block": block.name}, [], region, e.span)
    try:
        types = get_op(e.func).region_rule([v.type for v in values], op.attrs, op)
    except OpError as exc:
        where = exprs[0].span if "differentiate" in str(exc) else e.span
        raise el.error(f"`{e.func}` of block `{block.name}`: {exc}", where) from None
    op.results = [Value(t) for t in types]
    frame.region.ops.append(op)
    return op.results[0]


def custom_vjp(el: Elaborator, e: A.Call, env: dict, frame: _Frame):
    """A call of a block that declares `adjoint(...)`: a `custom_vjp` op holding the block and its adjoint."""
    block = el.model.blocks[e.func]
    if e.kwargs:
        raise el.error(f"block `{e.func}` has a declared adjoint: pass its arguments by position", e.kwargs[0].span)
    if e.func in frame.stack:
        raise el.error(f"block `{e.func}` calls itself ({' → '.join(frame.stack + (e.func,))})", e.span)
    values = [_tensor(el, el.eval(a, env, frame), a) for a in e.args]
    region = _region(el, e, block, values, list(e.args), frame)
    if any(isinstance(o, ParamRef) for op in region.walk() for o in op.operands):
        raise el.error(f"block `{e.func}` declares an adjoint, so it may not own parameters (its adjoint "
                       "gives cotangents of its inputs only)", block.span)
    adj = block.adjoint
    y = region.outputs[0]
    if len(adj.names) != len(values) + 2:
        raise el.error(f"the adjoint of `{e.func}` takes its {len(values)} input(s), the result and the result's "
                       f"cotangent: {len(values) + 2} names, got {len(adj.names)}", adj.span)
    args = [Value(t.type, n) for t, n in zip([*values, y, y], adj.names)]
    benv = dict(el.globals) | dict(zip(adj.names, args))
    inner = _Frame(Region(args, [], []), frame.prefix + (e.func, "adjoint"), frame.axes,
                   frame.stack + (e.func,), frame.root)
    outs = el.exec_body(A.Block(f"{e.func} adjoint", (), adj.body, adj.span), benv, inner)
    inner.region.outputs = [el.as_value(o, inner) for o in outs if isinstance(o, Tensor)]
    op = Op("custom_vjp", [el.as_value(v, frame) for v in values], {"block": e.func}, [], region, e.span,
            second=inner.region)
    try:
        types = get_op("custom_vjp").region_rule([v.type for v in values], op.attrs, op)
    except OpError as exc:
        raise el.error(f"`{e.func}`: {exc}", adj.span) from None
    op.results = [Value(t) for t in types]
    frame.region.ops.append(op)
    return op.results[0]
