"""The op registry: one `OpDef` per op — attributes, type rule, owned params, FLOPs — filled where ops are defined.

A type rule gets the types of the op's value operands and its (checked) attributes and returns the result
types; it raises `OpError` with a precise message (the caller adds the op and its position). `params`
returns the `ParamDecl`s an op owns, in operand order; their paths are the op's scope + the decl's name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from tessera.ir.types import Dim, DimName, Init, PerLayer, Struct, TensorType


class OpError(Exception):
    """A type rule or attribute check failed; the message says what is expected and what was got."""


REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class AttrDef:
    """An attribute: kind is int|float|bool|str|dim|dims|shape|struct:<family>, `?` suffix allows none."""

    name: str
    kind: str
    default: Any = REQUIRED
    per_layer: bool = False  # may differ per layer inside a repeat (a PerLayer table)


@dataclasses.dataclass(frozen=True)
class ParamDecl:
    """A parameter an op owns: local name, per-layer dims, initializer; `absolute` names a shared path."""

    name: str
    dims: tuple[Dim, ...]
    init: Init
    absolute: bool = False


TypeRule = Callable[[list[TensorType], dict], list[TensorType]]
ParamsRule = Callable[[dict, list[TensorType]], list[ParamDecl]]
FlopsRule = Callable[[list[TensorType], list[TensorType], dict], float]


def _no_params(attrs, types):
    return []


def _no_flops(ins, outs, attrs):
    return 0.0


@dataclasses.dataclass(frozen=True)
class OpDef:
    """Everything the compiler knows about one op."""

    name: str
    arity: tuple[int, int]  # min and max number of value operands
    attrs: tuple[AttrDef, ...]
    type_rule: TypeRule
    params: ParamsRule = _no_params
    flops: FlopsRule = _no_flops
    composite: bool = False  # expressible from primitives; `decompose` expands it
    region: bool = False  # holds a region (repeat)
    doc: str = ""

    def attr(self, name: str) -> AttrDef | None:
        return next((a for a in self.attrs if a.name == name), None)


OPS: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    """Add an op to the registry; a duplicate name is an error."""
    if opdef.name in OPS:
        raise ValueError(f"op `{opdef.name}` is registered twice")
    OPS[opdef.name] = opdef
    return opdef


def get_op(name: str) -> OpDef | None:
    """The registered op called `name` (loading the op library on first use)."""
    _load_library()
    return OPS.get(name)


def _load_library() -> None:
    from tessera.ir import ops_core, ops_nn  # noqa: F401  (registration happens on import)


# ---- structured attribute families: kind → {field: (attr kind, default)} ------------------------

STRUCTS: dict[str, dict[str, dict[str, tuple[str, Any]]]] = {
    "rope": {
        "rotary": {"theta": ("float", 10000.0)},
        "yarn": {"theta": ("float", 150000.0), "factor": ("float", 32.0), "original": ("int", 4096),
                 "beta_fast": ("float", 32.0), "beta_slow": ("float", 1.0), "truncate": ("bool", True)},
        "llama3": {"theta": ("float", 500000.0), "factor": ("float", 8.0), "original": ("int", 8192),
                   "low_freq_factor": ("float", 1.0), "high_freq_factor": ("float", 4.0)},
    },
    "act": {
        # alpha/limit none: silu(gate) * up; set: GPT-OSS clamped variant (see ops_nn.swiglu)
        "swiglu": {"alpha": ("float?", None), "limit": ("float?", None)},
    },
}


def check_value(kind: str, value: Any) -> Any:
    """Check (and normalise: int→float for floats) one attribute value of `kind`; raise OpError."""
    if kind.endswith("?"):
        if value is None:
            return None
        kind = kind[:-1]
    if isinstance(value, PerLayer):
        return PerLayer(tuple(check_value(kind + "?" if v is None else kind, v) for v in value.values))
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "str" and isinstance(value, str):
        return value
    if kind == "dim" and isinstance(value, DimName):
        return value
    if kind == "dims" and isinstance(value, tuple) and all(isinstance(v, DimName) for v in value):
        return value
    if kind == "shape" and isinstance(value, tuple) and all(isinstance(v, Dim) and v.size is not None
                                                            for v in value):
        return value
    if kind.startswith("struct:") and isinstance(value, Struct):
        return _check_struct(kind.split(":", 1)[1], value)
    raise OpError(f"expected {_describe(kind)}, got {describe_value(value)}")


def _check_struct(family: str, value: Struct) -> Struct:
    kinds = STRUCTS[family]
    if value.kind not in kinds:
        raise OpError(f"expected one of {', '.join(f'`{k}(...)`' for k in kinds)}, got `{value.kind}(...)`")
    schema = kinds[value.kind]
    given = dict(value.fields)
    for name in given:
        if name not in schema:
            raise OpError(f"`{value.kind}` has no field `{name}` (fields: {', '.join(schema)})")
    fields = []
    for name, (kind, default) in schema.items():
        try:
            v = check_value(kind, given.get(name, default))
            if kind.rstrip("?") in ("int", "float") and v is not None and not v > 0:  # NaN too
                raise OpError(f"must be greater than 0, got {v}")
            fields.append((name, v))
        except OpError as exc:
            raise OpError(f"`{value.kind}` field `{name}`: {exc}") from None
    return Struct(value.kind, tuple(fields))


def _describe(kind: str) -> str:
    names = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
             "dim": "a dimension name", "dims": "a list of dimension names",
             "shape": "a list of sized dimensions like [heads = 8, head_dim = 64]"}
    if kind.startswith("struct:"):
        return " or ".join(f"`{k}(...)`" for k in STRUCTS[kind.split(':', 1)[1]])
    return names.get(kind, kind)


def describe_value(value: Any) -> str:
    """A value as a user would recognise it in a message."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Struct):
        return f"`{value.kind}(...)`"
    if isinstance(value, DimName):
        return f"dimension `{value.name}`"
    if isinstance(value, TensorType):
        return f"a tensor {value}"
    return repr(value) if isinstance(value, str) else str(value)


def check_attrs(opdef: OpDef, attrs: dict) -> dict:
    """All of an op's attributes in declared order, defaults filled, each checked; raise OpError."""
    for name in attrs:
        if opdef.attr(name) is None:
            raise OpError(f"`{opdef.name}` has no attribute `{name}` "
                          f"(attributes: {', '.join(a.name for a in opdef.attrs) or 'none'})")
    out = {}
    for a in opdef.attrs:
        if a.name not in attrs:
            if a.default is REQUIRED:
                raise OpError(f"`{opdef.name}` needs attribute `{a.name}`")
            value = a.default
        else:
            value = attrs[a.name]
        if isinstance(value, PerLayer) and not a.per_layer:
            raise OpError(f"attribute `{a.name}` of `{opdef.name}` cannot differ per layer")
        try:
            out[a.name] = check_value(a.kind, value)
        except OpError as exc:
            raise OpError(f"attribute `{a.name}` of `{opdef.name}`: {exc}") from None
    return out


def layer_values(value: Any) -> tuple:
    """The distinct settings of a maybe-per-layer attribute (one entry when uniform)."""
    return tuple(dict.fromkeys(value.values)) if isinstance(value, PerLayer) else (value,)
