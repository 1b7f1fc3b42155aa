"""Elaboration of calls: registered ops, user blocks (inlined), `param`, struct values (`repeat` and `loop`:
elab_recurrence.py).

Scopes: a call's parameter scope is its `as` path, else the op's name; parameter paths are the enclosing
scopes joined with `/` plus the name the op declares (`layers/attention/q`). A block called by its name is
named from the innermost repeat's or loop's scope instead, and every call of it there reads one set of
parameters (`block_scope`).
"""

from __future__ import annotations

import re

from tessera.diagnostics import Span, did_you_mean
from tessera.grammar import model_ast as A
from tessera.ir.elaborate import Elaborator, LayerIndex, PTensor, Tensor, _Frame, _kind
from tessera.ir.registry import OPS, OpError, check_value, get_op, struct_family_of
from tessera.ir.types import Dim, DimName, Init, Op, Param, ParamRef, PerLayer, Struct, TensorType, Value

_DERIVATIVES = ("jvp", "vjp", "grad")
_INITS = {"normal": Init("normal", 0.02), "ones": Init("ones"), "zeros": Init("zeros")}


def call(el: Elaborator, e: A.Call, env: dict, frame: _Frame):
    """Evaluate a call expression."""
    if e.func in ("repeat", "loop"):
        from tessera.ir import elab_recurrence

        return getattr(elab_recurrence, e.func)(el, e, env, frame)
    if e.func == "param":
        return _param(el, e, env, frame)
    if e.func in _DERIVATIVES:
        from tessera.ir.elab_diff import derivative

        return derivative(el, e, env, frame)
    if e.func in el.model.blocks:
        if el.model.blocks[e.func].adjoint is not None:
            from tessera.ir.elab_diff import custom_vjp

            return custom_vjp(el, e, env, frame)
        return _inline(el, e, env, frame)
    family = struct_family_of(e.func)
    if get_op(e.func) is not None and (e.args or family is None):
        return _op_call(el, e, env, frame)
    if family is not None:
        return _struct(el, e, env)
    if e.func in _INITS:
        return _init(el, e, env)
    names = list(OPS) + list(el.model.blocks) + ["param"]
    raise el.error(f"unknown op or block `{e.func}`", e.span, hint=did_you_mean(e.func, names))


# ---- compile-time constructors --------------------------------------------------------------------

def _struct(el: Elaborator, e: A.Call, env: dict) -> Struct:
    if e.args:
        raise el.error(f"`{e.func}(...)` takes named fields only, like {e.func}(theta = 10000)", e.args[0].span)
    fields = tuple((k.name, el.eval(k.value, env)) for k in e.kwargs)
    try:
        return check_value(f"struct:{struct_family_of(e.func)}", Struct(e.func, fields))
    except OpError as exc:
        raise el.error(str(exc), e.span) from None


def _init(el: Elaborator, e: A.Call, env: dict) -> Init:
    if e.func != "normal":
        return _INITS[e.func]
    vals = [el.eval(a, env) for a in e.args] + [el.eval(k.value, env) for k in e.kwargs if k.name == "std"]
    if len(vals) != 1 or not isinstance(vals[0], (int, float)):
        raise el.error("write normal(std), e.g. normal(0.02)", e.span)
    return Init("normal", float(vals[0]))


# ---- param, block inlining (repeat and loop: elab_recurrence.py) ------------------------------------------------------------

def _scope(frame: _Frame, e: A.Call, default: str) -> tuple[str, ...]:
    return frame.prefix + tuple((e.scope or default).split("/"))


def block_scope(el: Elaborator, frame: _Frame, e: A.Call, block: str) -> tuple[tuple[str, ...], bool]:
    """(the scope a call of `block` names its parameters from, whether it reads an instance elaborated before).

    A block called by its name is one sub-network of the model: its scope is the innermost repeat's or loop's
    (the top level outside one) plus its name, wherever the call is (forward, a loss entry, another block, a
    derivative region), so `energy` calling `net` reads the same `@net/...` as `forward`'s `net(xy)`, and a
    second call of it reads the parameters the first declared. `as path` names a separate instance under the
    caller's scope (`energy/twin/...`)."""
    if e.scope:
        return frame.prefix + tuple(e.scope.split("/")), False
    scope = frame.root + (block,)
    again = el.instances.get(scope) == block
    el.instances.setdefault(scope, block)
    return scope, again


def _param(el: Elaborator, e: A.Call, env: dict, frame: _Frame) -> PTensor:
    if not e.scope:
        raise el.error("a `param(...)` needs a name: write param([...]) as name", e.span)
    if len(e.args) != 1 or not isinstance(e.args[0], A.ListExpr):
        raise el.error("write param([dim = size, ...], init = normal(0.02)) as name", e.span)
    dims = _shape(el, e.args[0], env)
    init = Init("normal", 0.02)
    for k in e.kwargs:
        if k.name != "init":
            raise el.error(f"`param` has no argument `{k.name}` (only `init`)", k.span)
        init = el.eval(k.value, env)
        if not isinstance(init, Init):
            raise el.error(f"init must be normal(std), ones or zeros, got {_kind(init)}", k.value.span)
    path = "/".join(frame.prefix + tuple(e.scope.split("/")))
    _declare(el, path, dims, init, frame, e.span)
    return PTensor(ParamRef(path), TensorType("f32", dims))


def _declare(el: Elaborator, path: str, dims: tuple, init: Init, frame: _Frame, span: Span,
             absolute: bool = False) -> None:
    stacked = TensorType("f32", tuple(Dim(a, n) for a, n in frame.axes) + tuple(dims))
    old = el.params.get(path)
    if absolute:
        if old is None or old.type.dims != tuple(dims):
            have = f"it has {old.type}" if old else "no op declares it"
            raise el.error(f"this op reads `@{path}` as [{', '.join(map(str, dims))}], but {have}", span)
        return
    if old is not None and (frame.shares or path in el.shared) and old.type == stacked and old.init == init:
        el.shared.add(path)  # a loss or a derivative reads the model's parameter by its path
        return
    if frame.shares:
        el.shared.add(path)
    if old is not None:
        first = f" (first at line {old.span.line})" if old.span else ""
        raise el.error(f"parameter `{path}` is declared twice{first}", span,
                       hint="name one of the ops with `as`, e.g. rmsnorm(x) as attn_norm")
    el.params[path] = Param(path, stacked, init, span)


def _inline(el: Elaborator, e: A.Call, env: dict, frame: _Frame):
    block = el.model.blocks[e.func]
    if e.func in frame.stack:
        raise el.error(f"block `{e.func}` calls itself ({' → '.join(frame.stack + (e.func,))})", e.span)
    given = list(e.args) + [k.value for k in e.kwargs]
    names = [p.name for p in block.params[: len(e.args)]] + [k.name for k in e.kwargs]
    params = {p.name: p for p in block.params}
    if len(e.args) > len(block.params):
        raise el.error(f"block `{e.func}` takes {len(block.params)} argument(s), got {len(e.args)}", e.span)
    benv = dict(el.globals)
    for name, expr in zip(names, given):
        if name not in params:
            raise el.error(f"block `{e.func}` has no parameter `{name}`", expr.span, hint=did_you_mean(name, params))
        value = el.eval(expr, env, frame)
        p = params[name]
        if isinstance(p.ann, A.TensorAnn):
            _check_ann(el, p, _tensor(el, value, expr).type, expr.span, e.func)
        benv[name] = value
    missing = [p.name for p in block.params if p.name not in names]
    if missing:
        raise el.error(f"block `{e.func}` needs argument `{missing[0]}`", e.span)
    scope, again = block_scope(el, frame, e, e.func)
    inner = _Frame(frame.region, scope, frame.axes, frame.stack + (e.func,), frame.root, frame.shares or again)
    outs = el.exec_body(block, benv, inner)
    return outs[0] if len(outs) == 1 else tuple(outs)


def _tensor(el: Elaborator, value, expr: A.Expr):
    if not isinstance(value, Tensor):
        raise el.error(f"expected a tensor, got {_kind(value)}", expr.span)
    return value


def _check_ann(el: Elaborator, p: A.Param, t: TensorType, span: Span, block: str) -> None:
    ann = p.ann
    names = tuple(d.name for d in ann.dims)
    bad = t.names != names or (ann.dtype is not None and t.dtype != ann.dtype)
    for d in ann.dims:
        if not bad and d.size is not None and t.dim(d.name).size != el.size(d.size, el.globals, d.name):
            bad = True
    if bad:
        raise el.error(f"argument `{p.name}` of block `{block}` has type {t}, but the block expects "
                       f"{ann.dtype or ''}[{', '.join(names)}]", span)


# ---- ops -------------------------------------------------------------------------------------------

def _op_call(el: Elaborator, e: A.Call, env: dict, frame: _Frame):
    opdef = get_op(e.func)
    lo, hi = opdef.arity
    data, rest = [], []
    for a in e.args:
        if len(data) < lo or (len(data) < hi and not rest and _looks_tensor(el, a, env)):
            data.append(_tensor(el, el.eval(a, env, frame), a))
        else:
            rest.append(a)
    if len(data) < lo:
        raise el.error(f"`{e.func}` takes {lo} tensor operand(s), got {len(data)}", e.span)
    exprs: dict[str, A.Expr] = {}
    positional = [a for a in opdef.attrs if a.name not in ("dtype",)]
    if len(rest) > len(positional):
        raise el.error(f"`{e.func}` takes at most {lo and hi} tensor(s) and {len(positional)} attribute(s), "
                       f"got {len(e.args)} arguments", rest[len(positional)].span)
    for adef, a in zip(positional, rest):
        exprs[adef.name] = a
    for k in e.kwargs:
        if opdef.attr(k.name) is None:
            names = [a.name for a in opdef.attrs]
            raise el.error(f"`{e.func}` has no argument `{k.name}`", k.span, hint=did_you_mean(k.name, names)
                           or f"arguments: {', '.join(names) or 'none'}")
        if k.name in exprs:
            raise el.error(f"argument `{k.name}` of `{e.func}` is given twice", k.span)
        exprs[k.name] = k.value
    attrs = {name: _attr_value(el, opdef.attr(name).kind, x, env) for name, x in exprs.items()}
    results = el.emit(frame, e.func, data, attrs, e.span, e.scope, exprs)
    return results[0] if len(results) == 1 else tuple(results)


def _looks_tensor(el: Elaborator, a: A.Expr, env: dict) -> bool:
    if isinstance(a, A.Name):
        return isinstance(env.get(a.id), Tensor)
    return isinstance(a, A.Call) and (a.func in el.model.blocks or a.func == "param" or get_op(a.func) is not None)


def _attr_value(el: Elaborator, kind: str, x: A.Expr, env: dict):
    base = kind.rstrip("?")
    if isinstance(x, A.Const) and x.value is None:
        return None
    if base == "dim":
        if not isinstance(x, A.Name):
            raise el.error("expected a dimension name", x.span)
        return DimName(x.id)
    if base == "dims":
        items = x.items if isinstance(x, A.ListExpr) else (x,)
        for i in items:
            if not isinstance(i, A.Name):
                raise el.error("expected a list of dimension names like [embed]", i.span)
        return tuple(DimName(i.id) for i in items)
    if base == "shape":
        if not isinstance(x, A.ListExpr):
            raise el.error("expected a shape like [heads = 8, head_dim = 64]", x.span)
        return _shape(el, x, env)
    if base.startswith("struct:") and isinstance(x, A.Call) and struct_family_of(x.func) is not None:
        return _struct(el, x, env)
    value = el.eval(x, env)
    if isinstance(value, LayerIndex):
        value = PerLayer(tuple(range(value.n)))
    if isinstance(value, Tensor):
        raise el.error(f"expected a compile-time value, got {_kind(value)}", x.span)
    return value


def _shape(el: Elaborator, x: A.ListExpr, env: dict) -> tuple:
    dims = []
    for item in x.items:
        if not isinstance(item, A.Sized):
            raise el.error("each dimension needs a size: [heads = 8, head_dim = 64]", item.span)
        dims.append(Dim(item.name, el.size(item.size, env, item.name)))
    return tuple(dims)


def emit_op(el: Elaborator, frame: _Frame, name: str, data: list, attrs: dict, span: Span, scope: str | None,
            exprs: dict) -> list[Value]:
    """Check attrs, run the type rule, declare owned params and append the op to the frame's region."""
    from tessera.ir.registry import check_attrs

    opdef = get_op(name)
    for aname, value in attrs.items():  # per-attribute errors point at the argument
        adef = opdef.attr(aname)
        try:
            if isinstance(value, PerLayer) and not adef.per_layer:
                raise OpError("cannot differ per layer")
            check_value(adef.kind, value)
        except OpError as exc:
            where = exprs[aname].span if aname in exprs else span
            raise el.error(f"argument `{aname}` of `{name}`: {exc}", where, notes=_notes(el, exprs, aname)) from None
    types = [t.type for t in data]
    try:
        attrs = check_attrs(opdef, attrs)
        out_types = opdef.type_rule(types, attrs)
        decls = opdef.params(attrs, types)
    except OpError as exc:
        mentioned = [a for a in exprs if re.search(rf"\b{a}\b", str(exc))]
        notes = [n for a in mentioned for n in _notes(el, exprs, a)]
        raise el.error(f"`{name}`: {exc}", span, notes=notes) from None
    for d in decls:  # a size of 0 or less from a model argument: refused here, not by a crash in the lowering
        small = [dim for dim in d.dims if isinstance(dim.size, int) and dim.size < 1]
        if small:
            given = [a for a in exprs if any(attrs.get(a) == dim.size for dim in small)]
            raise el.error(f"`{name}`: its parameter `{d.name}` would have "
                           f"{', '.join(f'{dim.name} = {dim.size}' for dim in small)}; every size must be at least 1",
                           span, notes=[n for a in given for n in _notes(el, exprs, a)])
    prefix = _scope(frame, A.Call(name, (), (), scope, span), name)
    refs = []
    for d in decls:
        path = d.name if d.absolute else "/".join(prefix + (d.name,))
        _declare(el, path, d.dims, d.init, frame if not d.absolute else _Frame(frame.region, (), (), ()),
                 span, d.absolute)
        refs.append(ParamRef(path))
    results = [Value(t) for t in out_types]
    operands = [el.as_value(t, frame) for t in data] + refs
    frame.region.ops.append(Op(name, operands, attrs, results, None, span))
    return results


def _notes(el: Elaborator, exprs: dict, attr: str) -> list:
    """Spec-side notes for the model arguments an attribute's expression reads."""
    x = exprs.get(attr)
    names = set()

    def walk(node):
        if isinstance(node, A.Name):
            names.add(node.id)
        for f in getattr(node, "__dataclass_fields__", {}):
            v = getattr(node, f)
            for c in (v if isinstance(v, tuple) else (v,)):
                if hasattr(c, "__dataclass_fields__") and not isinstance(c, Span):
                    walk(c)

    if x is not None:
        walk(x)
    return [n for name in sorted(names) for n in el.arg_note(name)]
