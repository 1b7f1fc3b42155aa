"""Graph IR data: tensor types with named dims, SSA values, params, ops, regions, graphs.

A graph is `inputs` + `params` + a top-level `Region` of ops in SSA order + outputs. `repeat` is one op
whose region is the per-layer block: its params are stored stacked with a leading `layers` axis, and
inside the region a param reference has the per-layer type (leading axis dropped). An op holds at most two
regions: `region`, and `second` (a custom_vjp's adjoint, a loop's halting condition).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from tessera.diagnostics import Span

# Element types spelled as in the IR text; numeric policies may add more (mxfp4, fp8 ...).
FLOAT_DTYPES = {"f32", "bf16", "f16", "f64", "fp8", "mxfp4", "c64", "c128"}
INT_DTYPES = {"i32", "i64", "i8", "u8", "bool"}
_DTYPE_ALIASES = {"fp32": "f32", "fp16": "f16", "fp64": "f64", "float32": "f32", "bfloat16": "bf16",
                  "float16": "f16", "int32": "i32", "int64": "i64"}


def canonical_dtype(name: str) -> str:
    """`fp32` → `f32` etc.; unknown names pass through (numeric policies may define more)."""
    return _DTYPE_ALIASES.get(name, name)


def is_float(dtype: str) -> bool:
    """Whether an element type holds real or complex floating point numbers."""
    return dtype not in INT_DTYPES


@dataclasses.dataclass(frozen=True)
class Dim:
    """One named dimension; `size` is None when only known at run time (batch, seq)."""

    name: str
    size: int | None = None

    def __str__(self) -> str:
        return self.name if self.size is None else f"{self.name}={self.size}"


@dataclasses.dataclass(frozen=True)
class TensorType:
    """Element type + named dims (+ later a shard spec: one mesh axis or None per dim)."""

    dtype: str
    dims: tuple[Dim, ...] = ()
    shard: tuple[str | None, ...] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    def dim(self, name: str) -> Dim | None:
        """The dim called `name`, or None."""
        return next((d for d in self.dims if d.name == name), None)

    def with_dims(self, dims) -> "TensorType":
        return TensorType(self.dtype, tuple(dims))

    def with_dtype(self, dtype: str) -> "TensorType":
        return dataclasses.replace(self, dtype=dtype)

    def numel(self) -> int | None:
        """Number of elements, or None when a dim is dynamic."""
        n = 1
        for d in self.dims:
            if d.size is None:
                return None
            n *= d.size
        return n

    def __str__(self) -> str:
        text = f"{self.dtype}[{', '.join(str(d) for d in self.dims)}]"
        if self.shard is not None:
            text += " | [" + ", ".join(a or "-" for a in self.shard) + "]"
        return text


def sized_type(dtype: str, **sizes: int) -> TensorType:
    """A tensor type with the named, sized dims given in order: `sized_type("f32", batch=2, seq=8)`."""
    return TensorType(dtype, tuple(Dim(n, s) for n, s in sizes.items()))


@dataclasses.dataclass(frozen=True)
class Init:
    """A parameter initializer: normal(std) | ones | zeros."""

    kind: str
    std: float | None = None

    def __str__(self) -> str:
        return f"normal({self.std!r})" if self.kind == "normal" else self.kind


@dataclasses.dataclass
class Param:
    """A graph parameter: path (`layers/attention/q`), stored type (stacked in a repeat), initializer."""

    path: str
    type: TensorType
    init: Init
    span: Span | None = dataclasses.field(default=None, compare=False)  # the op that declared it

    @property
    def axes(self) -> tuple[str, ...]:
        """Logical axes, one per dim (the names that `parallel.rules` maps onto mesh axes)."""
        return self.type.names


# ---- attribute values -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Struct:
    """A structured attribute value such as `yarn{theta = 150000.0, factor = 32.0}`."""

    kind: str
    fields: tuple[tuple[str, Any], ...]

    def get(self, name: str, default=None):
        return dict(self.fields).get(name, default)


@dataclasses.dataclass(frozen=True)
class PerLayer:
    """An attribute that differs per layer of the enclosing repeat: one entry per layer index."""

    values: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class DimName:
    """An attribute naming a dimension (printed bare)."""

    name: str


# ---- SSA -----------------------------------------------------------------------------------------

_ids = itertools.count()


class Value:
    """An SSA value: a graph input, a region argument or an op result. Identity is the object."""

    __slots__ = ("type", "name", "id")

    def __init__(self, type: TensorType, name: str | None = None):
        self.type = type
        self.name = name  # source name hint for inputs and region args; op results print as %N
        self.id = next(_ids)

    def __repr__(self) -> str:
        return f"Value({self.name or self.id}: {self.type})"


@dataclasses.dataclass(frozen=True)
class ParamRef:
    """An operand that reads a parameter (per-layer slice inside a repeat region)."""

    path: str


Operand = Value | ParamRef


@dataclasses.dataclass(eq=False)
class Op:
    """One operation: registry name, operands (values then the params it owns), attrs, results, region."""

    name: str
    operands: list[Operand]
    attrs: dict[str, Any]
    results: list[Value]
    region: "Region | None" = None
    span: Span | None = None  # where it came from (model source or IR text); not part of equality
    # a second region, written after the first under its op's keyword (`OpDef.second`): custom_vjp's declared
    # adjoint (inputs, result, cotangent), a loop's `until` condition (the carried state -> a halting predicate)
    second: "Region | None" = None

    @property
    def values(self) -> list[Value]:
        """The operands that are SSA values (not params)."""
        return [o for o in self.operands if isinstance(o, Value)]

    @property
    def result(self) -> Value:
        return self.results[0]

    @property
    def stacking(self) -> list[tuple[str, int]]:
        """The stacking axis a region op adds around its region's params: a repeat's (`layers`, n); none for a
        weight-shared repeat (`axis = none`) and for derivative regions."""
        axis = self.attrs.get("axis") if self.name == "repeat" else None
        return [(axis.name, self.attrs["n"])] if axis is not None else []

    @property
    def scope_name(self) -> str:
        """The name scope a region op's inner ops are labelled under: a repeat's axis (`layers`), `shared` for a
        weight-shared repeat, the op's name for other region ops."""
        axis = self.attrs.get("axis") if self.name == "repeat" else None
        return axis.name if axis is not None else ("shared" if self.name == "repeat" else self.name)

    def label(self, index: int, scope: str = "") -> str:
        """This op's name in HLO name scopes and profiles: the directory its parameters share
        (`layers/attention`), with the op's name added where the directory is not named after it
        (`layers/attn_norm/rmsnorm`); an op without parameters is `<scope>/<op>.<index in its region>`
        (`layers/add.2`), scope being the repeat axis around it."""
        dirs = [o.path.split("/")[:-1] for o in self.operands if isinstance(o, ParamRef)]
        common = dirs[0] if dirs else []
        for d in dirs[1:]:
            n = next((i for i, (a, b) in enumerate(zip(common, d)) if a != b), min(len(common), len(d)))
            common = common[:n]
        if not common:
            return "/".join([*([scope] if scope else []), f"{self.name}.{index}"])
        return "/".join(common if common[-1] == self.name else [*common, self.name])


@dataclasses.dataclass(eq=False)
class Region:
    """A block of ops: arguments, ops in SSA order, yielded values."""

    args: list[Value]
    ops: list[Op]
    outputs: list[Value]

    def walk(self):
        """Every op, depth first, regions included."""
        for op in self.ops:
            yield op
            if op.region is not None:
                yield from op.region.walk()
            if op.second is not None:
                yield from op.second.walk()


@dataclasses.dataclass(eq=False)
class Objective:
    """A model's `loss` entry: a region from its own inputs (collocation points, targets) to scalar terms,
    one per name in `terms`, reading the model's parameters by path."""

    name: str
    terms: tuple[str, ...]
    region: Region
    span: Span | None = dataclasses.field(default=None, compare=False)  # the `loss` entry in the model source


@dataclasses.dataclass(eq=False)
class Graph:
    """A whole model: inputs, params (by path, in declaration order), a body region, attributes."""

    name: str
    body: Region
    params: dict[str, Param]
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str | None = None  # the IR text it was parsed from, for excerpts in diagnostics
    losses: list[Objective] = dataclasses.field(default_factory=list)  # named loss terms (none: cross-entropy)

    @property
    def inputs(self) -> list[Value]:
        return self.body.args

    @property
    def outputs(self) -> list[Value]:
        return self.body.outputs

    def walk(self):
        yield from self.body.walk()
        for loss in self.losses:
            yield from loss.region.walk()

    @property
    def terms(self) -> tuple[str, ...]:
        """Every loss term the model names, in source order (empty: next-token cross-entropy)."""
        return tuple(t for loss in self.losses for t in loss.terms)

    def __eq__(self, other) -> bool:  # graphs are equal when their canonical texts are
        from tessera.ir.printer import print_graph

        return isinstance(other, Graph) and print_graph(self) == print_graph(other)

    __hash__ = None  # type: ignore[assignment]

    def __str__(self) -> str:
        from tessera.ir.printer import print_graph

        return print_graph(self)
