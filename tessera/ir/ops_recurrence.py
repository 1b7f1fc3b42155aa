"""Recurrence: `repeat` (a fixed number of steps) and `loop` (steps until a halting predicate, under a cap).

    repeat(n, block, x...)                       n steps, params stacked on a leading `layers` axis (one lax.scan)
    repeat(n, block, x..., shared = true)        n steps of one set of params (`axis = none`)
    loop(block, x..., until = halt, max = 16)    steps until `halt` says stop, at most 16, one set of params

Both carry their operands: the region takes them (a repeat's after the iteration index) and yields new values of
the same types. A loop's second region, `until`, takes the carried state and yields its halting predicate: a
float tensor (halted where it is > 0, e.g. q_halt - q_continue) or a bool one, whose dims every carried value
has. Each entry (each puzzle of a batch) halts on its own, checked before every step, and keeps its state from
then on; the loop ends when every entry has halted or after `max` steps. Inference lowers it to a
lax.while_loop, which skips the steps after the last entry halts; training to a lax.scan of `max` masked steps
(differentiable, the same values). FLOPs and costs count a loop at its cap.

`grad = "last"` is the one-step gradient of the Hierarchical Reasoning Model: the values of every step, the
gradient of the last one only, taken at the state the others reached (their inputs and params held under
stop_gradient), so training keeps the activations of one step whatever the depth. Carried values the region
yields unchanged (inputs that every step reads) keep their gradient. A loop's last step is each entry's last
applied one.
"""

from __future__ import annotations

from tessera.ir.registry import AttrDef, OpDef, OpError, register
from tessera.ir.types import DimName, Op, TensorType, is_float

GRADS = ("all", "last")  # every step's gradient | the one-step gradient


def _check_grad(attrs: dict) -> None:
    if attrs["grad"] not in GRADS:
        raise OpError(f'`grad` is "all" (every step) or "last" (the one-step gradient), got "{attrs["grad"]}"')


def _same(a: TensorType, b: TensorType) -> bool:
    return (a.dtype, a.dims) == (b.dtype, b.dims)


def kept_steps(attrs: dict, steps: int) -> int:
    """How many of `steps` steps keep activations for the backward pass: one under the one-step gradient."""
    return 1 if attrs.get("grad") == "last" else steps


def carried_args(op: Op) -> list:
    """The region arguments of a recurrence that its operands bind: a repeat's after the iteration index."""
    return op.region.args[1:] if op.name == "repeat" else op.region.args


def invariant(op: Op) -> list[bool]:
    """Which carried values a recurrence's region yields unchanged (inputs every step reads, not state): the
    argument itself, or what a recurrence inside carries through unchanged from it (HRM's input embedding)."""
    same = {a.id: a.id for a in carried_args(op)}  # value -> the argument it equals
    for inner in op.region.ops:
        if inner.name in ("repeat", "loop"):
            for v, r, through in zip(inner.values, inner.results, invariant(inner)):
                if through and v.id in same:
                    same[r.id] = same[v.id]
    return [same.get(y.id) == a.id for a, y in zip(carried_args(op), op.region.outputs)]


# ---- repeat --------------------------------------------------------------------------------------

def _repeat_rule(ins, attrs):
    _check_grad(attrs)
    if attrs["grad"] == "last" and attrs["axis"] is not None:
        raise OpError('`grad = "last"` needs one set of params for every step (`axis = none`: shared = true); '
                      "a stacked repeat's other layers would get no gradient")
    return list(ins)


register(OpDef("repeat", (1, 64), (AttrDef("n", "int"), AttrDef("axis", "dim?", DimName("layers")),
                                   AttrDef("grad", "str", "all")),
               _repeat_rule, region=True,
               region_args=lambda types, op: [[TensorType("i32", ()), *types]],
               runs=lambda attrs: (attrs["n"], 0), kept=lambda attrs: kept_steps(attrs, attrs["n"]),
               doc="run the region n times carrying the operands; params stacked on a leading `axis` "
                   "(one lax.scan); `axis = none`: one set of params shared by every iteration (a weight-shared "
                   "recurrence); the region's first argument is the iteration index; `grad = \"last\"`: the "
                   "gradient of the last iteration only"))


# ---- loop ----------------------------------------------------------------------------------------

def _takes(region, ins: list[TensorType], what: str) -> None:
    args = [a.type for a in region.args]
    if len(args) != len(ins) or not all(_same(a, t) for a, t in zip(args, ins)):
        raise OpError(f"{what} takes ({', '.join(map(str, args))}), but the loop carries "
                      f"({', '.join(map(str, ins))})")


def check_predicate(p: TensorType, ins: list[TensorType]) -> None:
    """A halting predicate: float or bool, with dims every carried value has; raise OpError."""
    if p.dtype != "bool" and (not is_float(p.dtype) or p.dtype in ("c64", "c128")):
        raise OpError(f"the halting predicate is a float tensor (halted where > 0) or a bool one, got {p}")
    for k, t in enumerate(ins):
        for d in p.dims:
            if t.dim(d.name) != d:
                raise OpError(f"the halting predicate {p} has dim `{d}`, but carried value {k} is {t}: every "
                              "carried value needs the predicate's dims (each entry halts the state it indexes)")


def _loop_rule(ins, attrs, op: Op):
    _check_grad(attrs)
    if attrs["max"] < 1:
        raise OpError(f"the cap `max` must be at least 1, got {attrs['max']}")
    if op.second is None:
        raise OpError("a loop needs its `until` region (the halting predicate)")
    _takes(op.region, ins, "the body")
    outs = [y.type for y in op.region.outputs]
    if len(outs) != len(ins):
        raise OpError(f"the body yields {len(outs)} value(s) but the loop carries {len(ins)}")
    for k, (y, t) in enumerate(zip(outs, ins)):
        if not _same(y, t):
            raise OpError(f"carried value {k} is {t} but the body yields {y}: a loop's state keeps its shape "
                          "and element type from one iteration to the next")
    _takes(op.second, ins, "`until`")
    if len(op.second.outputs) != 1:
        raise OpError(f"`until` yields one halting predicate, got {len(op.second.outputs)} values")
    check_predicate(op.second.outputs[0].type, ins)
    return list(ins)


def _no_type_rule(ins, attrs):  # typed by region_rule
    raise OpError("typed by its regions")


register(OpDef("loop", (1, 64), (AttrDef("max", "int"), AttrDef("grad", "str", "all")), _no_type_rule,
               region=True, region_rule=_loop_rule, second="until",
               runs=lambda attrs: (attrs["max"], attrs["max"] + 1),  # the condition: before each step, and after
               kept=lambda attrs: kept_steps(attrs, attrs["max"]),
               doc="run the region (one set of params) on the carried operands until the `until` region's "
                   "predicate is > 0 (or true) for every entry, each entry keeping its state once halted, at most "
                   "`max` times: lax.while_loop at inference, a scan of `max` masked steps in training; "
                   "`grad = \"last\"`: the gradient of each entry's last step only"))
