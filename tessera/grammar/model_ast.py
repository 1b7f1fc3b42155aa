"""Typed AST of the model language; every node carries the Span it was written at."""

from __future__ import annotations

import dataclasses
from typing import Any, Union

from tessera.diagnostics import Span


@dataclasses.dataclass(frozen=True)
class Name:
    id: str
    span: Span


@dataclasses.dataclass(frozen=True)
class Const:
    """A literal: int, float, str, bool or None."""

    value: Any
    span: Span


@dataclasses.dataclass(frozen=True)
class ListExpr:
    items: tuple["Expr", ...]
    span: Span


@dataclasses.dataclass(frozen=True)
class Sized:
    """`name = size` inside a list: a sized dimension, as in `[heads = 8, head_dim = 64]`."""

    name: str
    size: "Expr"
    span: Span


@dataclasses.dataclass(frozen=True)
class Kwarg:
    name: str
    value: "Expr"
    span: Span


@dataclasses.dataclass(frozen=True)
class Call:
    """`func(args, k = v) as scope`; scope is a `/`-separated path or None."""

    func: str
    args: tuple["Expr", ...]
    kwargs: tuple[Kwarg, ...]
    scope: str | None
    span: Span


@dataclasses.dataclass(frozen=True)
class BinOp:
    """Arithmetic, comparison, `and`, `or`: op is the operator's spelling."""

    op: str
    left: "Expr"
    right: "Expr"
    span: Span


@dataclasses.dataclass(frozen=True)
class Unary:
    """`-x` (op "neg") or `not x` (op "not")."""

    op: str
    operand: "Expr"
    span: Span


@dataclasses.dataclass(frozen=True)
class Ternary:
    cond: "Expr"
    then: "Expr"
    other: "Expr"
    span: Span


Expr = Union[Name, Const, ListExpr, Sized, Call, BinOp, Unary, Ternary]


@dataclasses.dataclass(frozen=True)
class DimDecl:
    name: str
    size: Expr | None
    span: Span


@dataclasses.dataclass(frozen=True)
class TensorAnn:
    """`i32[batch, seq]` or `[batch, seq, embed = d_model]` (element type optional)."""

    dtype: str | None
    dims: tuple[DimDecl, ...]
    span: Span


@dataclasses.dataclass(frozen=True)
class ScalarAnn:
    """`int`, `float`, `bool`, or `index` (the layer index of a repeated block)."""

    name: str
    span: Span


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    ann: TensorAnn | ScalarAnn | None
    default: Expr | None
    span: Span


@dataclasses.dataclass(frozen=True)
class Assign:
    names: tuple[str, ...]
    value: Expr
    span: Span


@dataclasses.dataclass(frozen=True)
class Return:
    values: tuple[Expr, ...]
    span: Span


@dataclasses.dataclass(frozen=True)
class Block:
    """A block (or the `forward` entry, named "forward"): parameters and statements."""

    name: str
    params: tuple[Param, ...]
    body: tuple[Assign | Return, ...]
    span: Span
    terms: tuple[str, ...] = ()  # a `loss` entry: the names of the scalars it returns
    adjoint: "Adjoint | None" = None  # a block's declared adjoint (custom VJP)


@dataclasses.dataclass(frozen=True)
class Adjoint:
    """`adjoint(x, ..., y, dy) { ... return dx, ... }` after a block: its inputs, result and the result's
    cotangent by name; it returns one cotangent per tensor input."""

    names: tuple[str, ...]
    body: tuple[Assign | Return, ...]
    span: Span


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    params: tuple[Param, ...]
    blocks: dict[str, Block]
    forward: Block
    span: Span
    file: str
    source: str = ""  # the text, for excerpts in diagnostics
    losses: dict[str, Block] = dataclasses.field(default_factory=dict)  # `loss` entries, in source order
