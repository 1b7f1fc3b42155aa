"""Lowerings of the region ops (tessera/ir/ops_diff.py): derivatives of a region with jax.jvp / jax.vjp /
jax.grad, and a block's declared adjoint with jax.custom_vjp.

The region is evaluated by `eval_region` as a function of its arguments; the parameters are closed over, so a
derivative inside a loss is itself differentiated with respect to them by the training step, and one inside
a `repeat` sees that layer's slice. Other operands than x are held constant.
"""

from __future__ import annotations

import jax

from tessera.ir.types import Op


def _fn(op: Op, params: dict, ctx, layer, rest: list):
    from tessera.lower.interpret import eval_region

    def f(x):
        (y,), _ = eval_region(op.region, [x, *rest], params, ctx, layer=layer)
        return y

    return f


def _jvp(op, ins, params, ctx, layer):
    x, v, rest = ins[0], ins[1], ins[2:]
    _, dy = jax.jvp(_fn(op, params, ctx, layer, rest), (x,), (v.astype(x.dtype),))
    return [dy]


def _vjp(op, ins, params, ctx, layer):
    x, ct, rest = ins[0], ins[1], ins[2:]
    y, pull = jax.vjp(_fn(op, params, ctx, layer, rest), x)
    return [pull(ct.astype(y.dtype))[0]]


def _grad(op, ins, params, ctx, layer):
    return [jax.grad(_fn(op, params, ctx, layer, ins[1:]))(ins[0])]


def _custom_vjp(op, ins, params, ctx, layer):
    from tessera.lower.interpret import eval_region

    def primal(*xs):
        (y,), _ = eval_region(op.region, list(xs), params, ctx, layer=layer)
        return y

    def fwd(*xs):
        y = primal(*xs)
        return y, (xs, y)

    def bwd(saved, ct):
        xs, y = saved
        outs, _ = eval_region(op.second, [*xs, y, ct], params, ctx, layer=layer)
        return tuple(o.astype(x.dtype) for o, x in zip(outs, xs))

    f = jax.custom_vjp(primal)
    f.defvjp(fwd, bwd)
    return [f(*ins)]


# region op -> (op, value operands, params, ctx, layer) -> results
REGION_LOWERINGS = {"jvp": _jvp, "vjp": _vjp, "grad": _grad, "custom_vjp": _custom_vjp}


def eval_region_op(op: Op, ins: list, params: dict, ctx, layer):
    """The results of a derivative or custom_vjp op."""
    return REGION_LOWERINGS[op.name](op, ins, params, ctx, layer)

