"""Derivatives as ops, and the few primitives a PDE residual needs besides the elementwise ones.

A derivative op holds a region: the differentiated block, elaborated once, reading the model's parameters
by path. Its first operand is the point x the derivative is taken at; trailing operands are the block's
other tensor arguments, held constant. Region arguments mirror (x, rest...); the region yields one value y.

    jvp(f, x, v, rest...)   -> dy = J_f(x) v            (y's type; v has x's type)
    vjp(f, x, ct, rest...)  -> J_f(x)^T ct              (x's type; ct has y's type)
    grad(f, x, rest...)     -> d f(x) / dx              (x's type; f must return a scalar)
    custom_vjp(xs...)       -> f(xs), differentiated by the block's declared adjoint (second region:
                               xs..., y, ct -> one cotangent per x)

Higher orders nest: a block that returns `jvp(net, x, e)` differentiated again gives second derivatives;
a Laplacian is a sum of such terms over unit tangents (`basis`). Lowered with jax.jvp / jax.vjp / jax.grad
(tessera/lower/derivatives.py).
"""

from __future__ import annotations

from tessera.ir.ops_core import _elementwise_flops, _unary_rule, need_dim, need_float
from tessera.ir.registry import AttrDef, OpDef, OpError, register
from tessera.ir.types import Dim, Op, TensorType, is_float

_BLOCK = (AttrDef("block", "str", ""),)  # the block's name in the source, for the reader


def _args_match(op: Op, operands: list[TensorType], what: str) -> None:
    """The region takes one argument per operand in `operands`, of the same types."""
    args = [a.type for a in op.region.args]
    if len(args) != len(operands):
        raise OpError(f"the region takes {len(args)} argument(s), but {what} give(s) {len(operands)}")
    for k, (a, t) in enumerate(zip(args, operands)):
        if (a.dtype, a.dims) != (t.dtype, t.dims):
            raise OpError(f"region argument {k} has type {a}, but the operand has type {t}")


def _one_output(op: Op) -> TensorType:
    outs = op.region.outputs
    if len(outs) != 1:
        raise OpError(f"the differentiated region must yield one value, got {len(outs)}")
    return outs[0].type


def _wrt(x: TensorType) -> None:
    if not is_float(x.dtype):
        raise OpError(f"cannot differentiate with respect to the integer input {x}; derivatives need a "
                      "floating point input")


def _same(t: TensorType, want: TensorType, what: str) -> None:
    if (t.dtype, t.dims) != (want.dtype, want.dims):
        raise OpError(f"{what} has type {t}, expected {want}")


def _jvp_rule(ins, attrs, op):
    if len(ins) < 2:
        raise OpError("jvp takes the point x, the tangent v, then the block's other arguments")
    x, v, rest = ins[0], ins[1], ins[2:]
    _wrt(x)
    _same(v, x, "the tangent")
    _args_match(op, [x, *rest], "x and the other arguments")
    return [_one_output(op)]


def _vjp_rule(ins, attrs, op):
    if len(ins) < 2:
        raise OpError("vjp takes the point x, the cotangent ct, then the block's other arguments")
    x, ct, rest = ins[0], ins[1], ins[2:]
    _wrt(x)
    _args_match(op, [x, *rest], "x and the other arguments")
    _same(ct, _one_output(op), "the cotangent")
    return [x]


def _grad_rule(ins, attrs, op):
    x, rest = ins[0], ins[1:]
    _wrt(x)
    _args_match(op, [x, *rest], "x and the other arguments")
    y = _one_output(op)
    if y.dims or not is_float(y.dtype):
        raise OpError(f"grad needs a region that returns a float scalar, got {y}; reduce it first, "
                      "e.g. sum(y, over = [points])")
    return [x]


def _custom_vjp_rule(ins, attrs, op):
    _args_match(op, list(ins), "the operands")
    y = _one_output(op)
    if op.second is None:
        raise OpError("custom_vjp needs its adjoint region")
    want = [*ins, y, y]
    args = [a.type for a in op.second.args]
    if [(a.dtype, a.dims) for a in args] != [(t.dtype, t.dims) for t in want]:
        raise OpError(f"the adjoint takes the inputs, the result and its cotangent ({', '.join(map(str, want))}), "
                      f"got ({', '.join(map(str, args))})")
    outs = [v.type for v in op.second.outputs]
    if [(t.dtype, t.dims) for t in outs] != [(t.dtype, t.dims) for t in ins]:
        raise OpError(f"the adjoint must return one cotangent per input ({', '.join(map(str, ins))}), "
                      f"got ({', '.join(map(str, outs))})")
    return [y]


def _no_type_rule(ins, attrs):  # region ops are typed by region_rule
    raise OpError("typed by its region")


def _skip_operand_1(types, op):  # jvp's tangent, vjp's cotangent: no argument of the region
    return [[types[0], *types[2:]]]


def _adjoint_args(types, op):  # the block's inputs; the adjoint's: the inputs, the result, its cotangent
    y = op.region.outputs[0].type
    return [list(types), [*types, y, y]]


for _name, _rule, _lo, _args, _doc in [
        ("jvp", _jvp_rule, 2, _skip_operand_1, "directional derivative J_f(x) v of the region f at x (jax.jvp)"),
        ("vjp", _vjp_rule, 2, _skip_operand_1, "cotangent pullback J_f(x)^T ct of the region f at x (jax.vjp)"),
        ("grad", _grad_rule, 1, None, "gradient of the scalar region f at x (jax.grad)"),
        ("custom_vjp", _custom_vjp_rule, 1, _adjoint_args,
         "f(xs), differentiated by the adjoint region (jax.custom_vjp)")]:
    register(OpDef(_name, (_lo, 64), _BLOCK, _no_type_rule, region=True, region_rule=_rule, region_args=_args,
                   second="adjoint" if _name == "custom_vjp" else None, doc=_doc))


# ---- primitives residuals need ---------------------------------------------------------------------

for _name, _doc in [("sin", "sin(x)"), ("cos", "cos(x)"), ("square", "x * x")]:
    register(OpDef(_name, (1, 1), (), _unary_rule, flops=_elementwise_flops, doc=_doc))

# x forward, no gradient back: a recurrence trained through its last step only (the one-step gradient) writes
# h = stop_gradient(repeat(n - 1, f, h, shared = true)) then f(h); the first n - 1 steps keep no residuals
register(OpDef("stop_gradient", (1, 1), (), lambda ins, attrs: [ins[0]],
               doc="x in the forward pass; its gradient is zero (jax.lax.stop_gradient)"))


def _take_rule(ins, attrs):
    x, d = ins[0], need_dim(ins[0], attrs["dim"].name)
    if d.size is None or not 0 <= attrs["index"] < d.size:
        raise OpError(f"index {attrs['index']} is outside dimension `{d.name}` of {x}")
    return [x.with_dims(e for e in x.dims if e.name != d.name)]


register(OpDef("take", (1, 1), (AttrDef("dim", "dim"), AttrDef("index", "int")), _take_rule,
               doc="entry `index` along `dim`, which the result drops (u = take(uvp, field, 0))"))


def _basis_rule(ins, attrs):
    x, d = ins[0], need_dim(ins[0], attrs["dim"].name)
    need_float(x)
    if d.size is None or not 0 <= attrs["index"] < d.size:
        raise OpError(f"index {attrs['index']} is outside dimension `{d.name}` of {x}")
    return [x]


register(OpDef("basis", (1, 1), (AttrDef("dim", "dim"), AttrDef("index", "int")), _basis_rule,
               doc="a tensor of x's type: 1 where the `dim` coordinate is `index`, 0 elsewhere (a unit tangent)"))


def _mean_rule(ins, attrs):
    names = [d.name for d in attrs["over"]]
    for n in names:
        need_dim(ins[0], n)
    need_float(ins[0])
    return [ins[0].with_dims(d for d in ins[0].dims if d.name not in names)]


register(OpDef("mean", (1, 1), (AttrDef("over", "dims"),), _mean_rule,
               flops=lambda i, o, a: 0.0, doc="mean over the named dims"))


def _stack_rule(ins, attrs):
    first = ins[0]
    for t in ins[1:]:
        _same(t, first, "every operand")
    if first.dim(attrs["dim"].name) is not None:
        raise OpError(f"operands {first} already have a dimension `{attrs['dim'].name}`")
    return [first.with_dims(first.dims + (Dim(attrs["dim"].name, len(ins)),))]


register(OpDef("stack", (1, 64), (AttrDef("dim", "dim"),), _stack_rule,
               doc="the operands side by side along a new last dim `dim` of their count (inverse of take)"))
