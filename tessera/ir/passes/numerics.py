"""numerics: element types from the spec's numeric policy.

Params are stored in `params` (master weights), then each rule whose glob matches the param path
(fnmatch: `*` crosses `/`) sets its type, the last match winning. Activations take the base type of
`default` (the embedding's output type and float graph inputs), and result types are re-inferred.
The policy's accumulation type is recorded as the graph attribute `accum`. Under `fp8_e4m3 @scale(per_tensor)` (or
`@scale(per_block(N))`, `@scale(delayed(H))`)
activations are bf16 and the graph attribute `fp8` (the scaling, sizes written out: `delayed` is `delayed(16)`)
tells the lowering to run the products with weights in fp8 (tessera/lower/reference/fp8.py). A `numerics.compute`
rule (glob on an op's label -> type) lists the op's label in the graph attribute `fp8_out` (its products kept in the
program's compute type) or `fp8_in` (the unembedding's put in fp8); `fp8_op` reads them.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from tessera.grammar.numerics import held_name
from tessera.ir.passes import register_pass
from tessera.ir.passes.rewrite import regions, retype
from tessera.ir.types import Graph, ParamRef, canonical_dtype, is_float


def numeric(value: Any):
    """A NumericType from the spec, or parsed from its text (`bf16 @accum(fp32)`)."""
    if isinstance(value, str):
        from tessera.grammar.numerics import parse

        return parse(value)
    return value


def _get(policy: Any, key: str, default=None):
    return policy.get(key, default) if isinstance(policy, dict) else getattr(policy, key, default)


def param_dtype(path: str, policy: Any) -> str:
    """The storage type of the param at `path` under `policy` (last matching rule wins): the rule's base type,
    or for `fp8_e4m3 @scale(per_block(N))` the block-scaled `fp8_e4m3_bN` (grammar.numerics.held_name)."""
    dtype = held_name(numeric(_get(policy, "params", "fp32")))
    for glob, t in (_get(policy, "rules") or {}).items():
        if fnmatch.fnmatchcase(path, glob):
            dtype = held_name(numeric(t))
    return canonical_dtype(dtype)


def apply_numerics(graph: Graph, ctx) -> Graph:
    """Set param, activation and accumulation types from ctx.numerics (unchanged when None)."""
    policy = getattr(ctx, "numerics", None)
    if policy is None:
        return graph
    default = numeric(_get(policy, "default", "fp32"))
    fp8 = default.base == "fp8_e4m3"  # products with weights in fp8, everything else in bf16
    compute = "bf16" if fp8 else canonical_dtype(default.base)
    for p in graph.params.values():
        p.type = p.type.with_dtype(param_dtype(p.path, policy))
    for v in [*graph.inputs, *(a for loss in graph.losses for a in loss.region.args)]:
        if is_float(v.type.dtype):
            v.type = v.type.with_dtype(compute)
    for region, _ in regions(graph):
        for op in region.ops:
            if "dtype" in op.attrs:
                op.attrs = {**op.attrs, "dtype": compute}
    ops = rule_fp8_ops(graph, policy) or {}  # whether each op's products run in fp8 (`fp8_op`)
    for key, want in (("fp8_in", True), ("fp8_out", False)):
        if any(on is want for on in ops.values()):
            graph.attrs[key] = tuple(label for label, on in ops.items() if on is want)
    graph.attrs["compute"] = compute
    if fp8:
        graph.attrs["fp8"] = default.scale.explicit if default.scale is not None else "per_tensor"
    if default.accum is not None:
        graph.attrs["accum"] = canonical_dtype(default.accum)
    return retype(graph)


register_pass("numerics", apply_numerics)



_FP32_STATISTICS = ("rmsnorm", "layernorm")  # ops whose parameters scale fp32 statistics (lower/reference/norms.py)
# (op, param) whose products run in fp8 under an fp8 policy (tessera/lower/ops_nn.py: _weight_product, _linear; the
# experts' grouped products through table.choose)
_FP8_WEIGHTS = {("attention", n) for n in "qkvo"} | {(op, n) for op in ("mlp", "moe") for n in ("gate", "up", "down")} \
    | {("linear", "weight")}


# ops a `numerics.compute` rule may name (their products with weights can run in fp8), and the weights that run in
# fp8 only where such a rule puts their op in: the unembedding's (or the tied table's), which Transformer Engine's,
# torchtitan's and DeepSeek-V3's recipes keep in the compute type
FP8_OPS = ("linear", "attention", "mlp", "moe", "unembed")
_OPT_IN = {("unembed", "weight"), ("unembed", "table")}


def fp8_op(op, fp8_ops: dict | None) -> bool:
    """Whether `op`'s products with weights run in fp8 in a program with fp8 products: the policy's ops (linear,
    attention, mlp, moe) unless a `numerics.compute` rule keeps the op in the compute type, and the unembedding
    where a rule puts it in. `fp8_ops`: {op label: in fp8} from those rules (`fp8_ops_of`)."""
    if op.name not in FP8_OPS:
        return False
    on = (fp8_ops or {}).get(op.label(0))
    return on is True if op.name == "unembed" else on is not False


def fp8_ops_of(attrs: dict) -> dict[str, bool] | None:
    """{op label: its products in fp8} from the graph attributes `fp8_in` / `fp8_out` (the labels `numerics.compute`
    rules put in or kept out of fp8), or None without such rules."""
    ops = {**{label: False for label in attrs.get("fp8_out", ())}, **{label: True for label in attrs.get("fp8_in", ())}}
    return ops or None


def fp8_product(op, param: str, fp8_ops: dict | None = None) -> bool:
    """Whether weight `param` (the name after its last `/`) of `op` runs its product in fp8 under an fp8 policy
    (linear's weight, attention's q/k/v/o, the MLP's and experts' gate/up/down, the unembedding's weight or tied
    table; `fp8_op` says whether the op does)."""
    return ((op.name, param) in _FP8_WEIGHTS or (op.name, param) in _OPT_IN) and fp8_op(op, fp8_ops)


def fp8_op_labels(graph: Graph) -> dict[str, str]:
    """{op label: op name} of `graph`'s ops whose products with weights can run in fp8 (FP8_OPS): what a
    `numerics.compute` rule's glob is matched against."""
    out: dict[str, str] = {}
    for region, _ in regions(graph):
        for op in region.ops:
            if op.name in FP8_OPS:
                out.setdefault(op.label(0), op.name)
    return out


def rule_fp8_ops(graph: Graph, policy) -> dict[str, bool] | None:
    """{op label: its products in fp8} that `policy`'s `numerics.compute` rules decide for `graph`'s ops (before or
    after this pass), or None without a rule that matches."""
    out = {}
    for label in fp8_op_labels(graph):
        rule = compute_rule(label, policy)
        if rule is not None:
            out[label] = rule[1].base == "fp8_e4m3"
    return out or None


def compute_rule(label: str, policy) -> tuple[str, Any] | None:
    """(glob, type) of the last `numerics.compute` rule whose glob matches an op's label (`Op.label`: its
    parameters' directory, e.g. `layers/attention`, `embed/unembed`), or None."""
    found = None
    for glob, t in (_get(policy, "compute") or {}).items():
        if fnmatch.fnmatchcase(label, glob):
            found = (glob, numeric(t))
    return found


def fp8_product_dims(op_name: str, param: str, attrs: dict) -> tuple[int, int]:
    """(contracted, total) trailing dims of weight `param` (the name after its last `/`) in one fp8 product of op
    `op_name`; any dims before them are stacked by a repeat. The experts' matrices [.., experts, in, out] count
    the experts dim in `total`: one grouped product covers all experts."""
    if op_name == "linear":
        return len(attrs["over"]), len(attrs["over"]) + len(attrs["out"])
    if op_name == "attention":
        return (2 if param == "o" else 1), 3
    if op_name == "moe":
        return 1, 3
    return 1, 2  # mlp


def fp8_weight_uses(graph: Graph):
    """(op, param path, weight name) at the first use of every weight whose product runs in fp8 under an fp8
    policy, in first-use order."""
    seen: set[str] = set()
    fp8_ops = fp8_ops_of(graph.attrs)
    for region, _ in regions(graph):
        for op in region.ops:
            for ref in op.operands:
                if not isinstance(ref, ParamRef) or ref.path in seen or ref.path not in graph.params:
                    continue
                name = ref.path.rsplit("/", 1)[-1]
                if fp8_product(op, name, fp8_ops):
                    seen.add(ref.path)
                    yield op, ref.path, name


def fp8_weights(graph: Graph) -> dict[str, int]:
    """{path: number of leading (stacked) dims} of every weight whose product runs in fp8 under an fp8 policy, in
    first-use order. Under delayed scaling each keeps an amax history of shape leading dims + (3, H)
    (tessera/lower/fp8_delayed.py)."""
    return {path: len(graph.params[path].type.dims) - fp8_product_dims(op.name, name, op.attrs)[1]
            for op, path, name in fp8_weight_uses(graph)}


def resolved_policy(graph: Graph, policy: Any) -> dict:
    """What runs in which precision, after this pass: the compute and accumulation types, the loss scaling, and
    per parameter path its storage type (the IR's element type), the type it is computed in (cast or dequantised
    to at use) and the numerics rule that set its storage (None: `params`). For `tessera plan` and the manifest."""
    compute = graph.attrs.get("compute", "f32")
    loss = str(_get(policy, "loss_scale", "none") or "none")
    default = numeric(_get(policy, "default", "fp32")) if policy is not None else None
    if loss == "none" and default is not None and default.loss_scale is not None:
        loss = "dynamic" if default.loss_scale == "dynamic" else f"static({default.loss_scale})"
    rules = _get(policy, "rules") or {}
    fp8_ops = fp8_ops_of(graph.attrs)
    owner = {ref.path: op for region, _ in regions(graph) for op in region.ops
             for ref in op.operands if isinstance(ref, ParamRef)}
    params = {}
    for path, p in graph.params.items():
        rule = None
        for glob in rules:
            if fnmatch.fnmatchcase(path, glob):
                rule = glob
        used = compute if is_float(p.type.dtype) else p.type.dtype
        op = owner.get(path)
        if (op is not None and op.name in _FP32_STATISTICS) or path.endswith("/sinks"):  # scales of fp32 statistics
            used = "f32"
        elif graph.attrs.get("fp8") and op is not None and fp8_product(op, path.rsplit("/", 1)[-1], fp8_ops):
            used = "fp8_e4m3"
        params[path] = {"storage": p.type.dtype, "compute": used, "rule": rule}
    out = {"compute": compute, "accumulate": graph.attrs.get("accum", "f32"), "loss_scale": loss,
           "fp8_products": graph.attrs.get("fp8"), "by_param": params}
    if fp8_ops:  # the ops numerics.compute rules decided (labels as in profiles)
        out["by_op"] = {label: {"fp8": on, "rule": compute_rule(label, policy)[0]} for label, on in fp8_ops.items()}
    scaling = graph.attrs.get("fp8") or ""
    if scaling.startswith("delayed("):  # tessera/lower/fp8_delayed.py
        out["fp8_amax_history"] = {"length": int(scaling[len("delayed("):-1]), "operands": ["input", "weight", "grad"],
                                   "weights": list(fp8_weights(graph)), "inference": "current amax (per_tensor)"}
    return out
