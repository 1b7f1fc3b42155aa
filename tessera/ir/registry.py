"""The op registry: one `OpDef` per op holding every fact the compiler knows about it, filled where ops are defined.

A type rule gets the types of the op's value operands and its (checked) attributes and returns the result
types; it raises `OpError` with a precise message (the caller adds the op and its position). `params`
returns the `ParamDecl`s an op owns, in operand order; their paths are the op's scope + the decl's name.
The remaining slots are what the passes, the cost model and the sharded lowering read about the op
(FLOPs, contraction, active fraction, saved tensors, native splits, decomposition); none of them is kept
in a table keyed by op name elsewhere.

Structured attributes (`rope = yarn{...}`, `act = swiglu{...}`) come in families; each kind is a
`StructKind`, registered beside the op that reads it, and the lowering registers one implementation per
kind (`tessera.lower.table.lowers_kind`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from tessera.ir.types import Dim, DimName, Init, Op, PerLayer, Struct, TensorType


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
# (attrs, local name of a param the op owns, or None for a param read as data) -> fraction one token reads
ActiveRule = Callable[[dict, str | None], float]
# (first operand at run-time sizes, attrs) -> [(type, is a contraction output)] kept for backward
SavedRule = Callable[[TensorType, dict], list[tuple[TensorType, bool]]]
# (a rewrite Builder, the op, its data operands, its params by local name) -> values replacing its results
DecomposeRule = Callable[[Any, Op, list, dict], list]
# (attrs, result dtype, batch, max_len) -> per layer variant (a PerLayer attribute's entries), the tensors the
# op keeps from one decode step to the next (an attention's KV cache); layers share the variants equally
StateRule = Callable[[dict, str, int, int], list[list[TensorType]]]
# (attrs, operands at run-time sizes, result dtype) -> tensors of the whole sequence the op gathers when its
# first operand is split over `seq` (sequence parallelism: an attention's keys and values)
SeqGatherRule = Callable[[dict, list[TensorType], str], list[TensorType]]


# attrs -> how many times its region and its second region run in one forward pass, at most: what FLOPs and
# costs count (a repeat n times, a loop its cap; a declared adjoint never: it runs in the backward pass)
RunsRule = Callable[[dict], tuple[int, int]]
# attrs -> how many of its region's runs keep activations for the backward pass (the one-step gradient: 1)
KeptRule = Callable[[dict], int]


def _runs_once(attrs):
    return (1, 0)


def _no_params(attrs, types):
    return []


def _no_flops(ins, outs, attrs):
    return 0.0


def _reads_all(attrs, name):
    return 1.0


@dataclasses.dataclass(frozen=True)
class OpDef:
    """Everything the compiler knows about one op.

    contraction: its work is products with weights or keys (backward costs 2x forward; its output is kept
    under remat `dots`). active_fraction: the fraction of each param one token reads (a lookup reads one
    row, a MoE top_k of its experts). saved: tensors the op keeps for its backward besides its results (a
    composite's internals; None: only its results). native_split: (param-name glob, logical axes) whose
    splits the sharded lowering handles itself with its own collectives; every other split dim of a param
    is all-gathered before use. decompose: expands the op into primitives (`tessera ir --after
    decompose`); None for a primitive. state: what it keeps between decode steps (its KV cache; None:
    nothing). seq_gather: what it gathers over the sequence under sequence parallelism (None: nothing).
    whole_dims: the dims (by name, from its attrs) it needs whole on every device (a Fourier transform's);
    `tessera check` refuses a mesh that splits one. runs: how many times its regions run in a forward pass
    (FLOPs and costs count them so: a data-dependent loop at its cap). kept: how many of those runs keep
    activations for backward (None: all of them).
    """

    name: str
    arity: tuple[int, int]  # min and max number of value operands
    attrs: tuple[AttrDef, ...]
    type_rule: TypeRule
    params: ParamsRule = _no_params
    flops: FlopsRule = _no_flops
    contraction: bool = False
    active_fraction: ActiveRule = _reads_all
    saved: SavedRule | None = None
    native_split: tuple[tuple[str, tuple[str, ...]], ...] = ()
    decompose: DecomposeRule | None = None
    state: StateRule | None = None
    seq_gather: SeqGatherRule | None = None
    whole_dims: Callable[[dict], tuple[str, ...]] | None = None
    region: bool = False  # holds a region (repeat, loop, the derivatives)
    # an op whose result types come from its region (jvp, grad, vjp, custom_vjp, loop): (operand types, attrs, op)
    # -> result types, checking the region's arguments and outputs against the operands; raises OpError
    region_rule: Callable[[list[TensorType], dict, Op], list[TensorType]] | None = None
    second: str | None = None  # the keyword of its second region in the IR text (`adjoint`, `until`); None: none
    # (operand types, op) -> the argument types of each of its regions (the first, then the second), which
    # `retype` gives them after the operands change type; None: every region takes the operand types
    region_args: Callable[[list[TensorType], Op], list[list[TensorType]]] | None = None
    runs: RunsRule = _runs_once
    kept: KeptRule | None = None
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
    from tessera.ir import ops_core, ops_diff, ops_nn, ops_recurrence, ops_spectral  # noqa: F401  (they register)


# ---- structured attribute families -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StructKind:
    """One kind of a structured attribute family (`yarn` of `rope`): its fields, each an AttrDef with its default.

    Kind names are unique over all families, since the model language writes a kind by name alone
    (`rope = yarn(factor = 32.0)`).
    """

    family: str
    name: str
    fields: tuple[AttrDef, ...]
    doc: str = ""


STRUCTS: dict[str, dict[str, StructKind]] = {}  # family -> kind name -> kind


def register_struct(kind: StructKind) -> StructKind:
    """Add a kind to its family; a kind name registered twice (in any family) is an error."""
    if any(kind.name in kinds for kinds in STRUCTS.values()):
        raise ValueError(f"struct kind `{kind.name}` is registered twice")
    STRUCTS.setdefault(kind.family, {})[kind.name] = kind
    return kind


def struct_families() -> dict[str, dict[str, StructKind]]:
    """Every struct family with its kinds (loading the op library on first use)."""
    _load_library()
    return STRUCTS


def struct_family_of(kind: str) -> str | None:
    """The family a kind name belongs to, or None when it names no kind."""
    return next((f for f, kinds in struct_families().items() if kind in kinds), None)


def struct_fields(value: Struct) -> dict[str, Any]:
    """A struct's fields by name, with its kind's defaults for the fields it leaves out."""
    kind = struct_families()[struct_family_of(value.kind)][value.kind]
    return {f.name: f.default for f in kind.fields} | dict(value.fields)


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
    kinds = struct_families()[family]
    if value.kind not in kinds:
        raise OpError(f"expected one of {', '.join(f'`{k}(...)`' for k in kinds)}, got `{value.kind}(...)`")
    schema = kinds[value.kind].fields
    given = dict(value.fields)
    for name in given:
        if not any(f.name == name for f in schema):
            raise OpError(f"`{value.kind}` has no field `{name}` (fields: {', '.join(f.name for f in schema)})")
    fields = []
    for field in schema:
        try:
            v = check_value(field.kind, given.get(field.name, field.default))
            if field.kind.rstrip("?") in ("int", "float") and v is not None and not v > 0:  # NaN too
                raise OpError(f"must be greater than 0, got {v}")
            fields.append((field.name, v))
        except OpError as exc:
            raise OpError(f"`{value.kind}` field `{field.name}`: {exc}") from None
    return Struct(value.kind, tuple(fields))


def _describe(kind: str) -> str:
    names = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
             "dim": "a dimension name", "dims": "a list of dimension names",
             "shape": "a list of sized dimensions like [heads = 8, head_dim = 64]"}
    if kind.startswith("struct:"):
        return " or ".join(f"`{k}(...)`" for k in struct_families()[kind.split(':', 1)[1]])
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
