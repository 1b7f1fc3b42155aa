"""Model-level checks of an experiment: elaborate its model, then small named checks against the spec.

Each check returns diagnostics that point into both files where it can: the spec key that is wrong
and the model-source op that owns the tensor it is wrong about.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Callable

from tessera.diagnostics import Diagnostic, Span, TesseraError
from tessera.grammar.numerics import held_name
from tessera.ir.types import Graph, ParamRef
from tessera.spec.tasks import trains


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_params_divide(params, rules, span: Callable[[str], Span | None]) -> list[Diagnostic]:
    """Every parameter dim that mesh axes split is divisible by their product; `span(key)` locates a spec key
    (`Experiment.span`).

    The split is `AxisRules`' (the spec's rules, size-1 axes dropped, the stacked layers over pp), the one the
    shard pass annotates and the lowering shards by. One error per (dim, axes), at the mesh axis that does not
    fit, with notes at the spec's rule (where the spec wrote one) and at the parameter's declaration.
    """
    sizes, out, seen = dict(rules.sizes), [], set()
    for p in params.values():
        for d, axes in zip(p.type.dims, rules.dims(p.type.names)):
            n = rules.size(axes)
            if d.size is None or n <= 1 or d.size % n == 0 or (d.name, axes) in seen:
                continue
            seen.add((d.name, axes))
            where = " × ".join(f"{a}={sizes[a]}" for a in axes)
            ds = divisors(d.size)
            ok = ", ".join(map(str, ds[:6])) + (" ..." if len(ds) > 6 else "")
            key = f"mesh.{axes[-1]}"
            out.append(Diagnostic(f"{where} does not divide `{d.name}` = {d.size} (param `{p.path}`)",
                                  span=span(key), key=key,
                                  hint=f"use a mesh whose {' × '.join(axes)} divides {d.size}: {ok}"))
            rule = span(f"parallel.rules.{d.name}")
            if rule is not None:
                out.append(Diagnostic(f"`{d.name}` is split over {' × '.join(axes)} by this rule", span=rule,
                                      severity="note"))
            if p.span is not None:
                out.append(Diagnostic(f"`{p.path}` is declared here with `{d.name}` = {d.size}", span=p.span,
                                      severity="note"))
    return out


def check_mesh_divides(exp, graph: Graph) -> list[Diagnostic]:
    """`check_params_divide` over the model's parameters (what `tessera check` runs)."""
    from tessera.ir.passes.shard import AxisRules

    return check_params_divide(graph.params, AxisRules.from_experiment(exp), exp.span)


def check_numeric_rules(exp, graph: Graph) -> list[Diagnostic]:
    """Every numerics rule matches at least one parameter path."""
    out = []
    for glob in (exp.numerics.rules or {}):
        if not any(fnmatch.fnmatchcase(path, glob) for path in graph.params):
            out.append(Diagnostic(f"numeric rule `{glob}` matches no parameter of model `{graph.name}`",
                                  span=exp.span(f"numerics.rules.{glob}") or exp.span("numerics.rules"),
                                  key="numerics.rules", hint="parameter paths look like " +
                                  ", ".join(list(graph.params)[:3])))
    return out


COMPUTE_TYPES = ("fp32", "bf16", "fp16", "fp64")  # what activations can be computed in (tessera/lower/context.py);
# fp64: models with loss entries only (check_objectives)


FP8_COMPUTE = "fp8_e4m3 @scale(per_tensor)"  # products with weights in fp8 (tessera/lower/reference/fp8.py)
# delayed(H) compute: the same products, scaled from an amax history carried in the train state
# (tessera/lower/fp8_delayed.py): each fp8 weight read by one product a step (see _delayed_fp8_problems)
# per_block(N) compute: the same products as per_tensor, each weight's contracted size and kept size whole numbers
# of N (tessera/lower/reference/fp8_per_block.py: block_einsum, ragged_blocked)


def _fp8_weights(graph: Graph):
    """(param, contracted dims, kept dims) for each weight whose product runs in fp8 (a dense product: its true dims
    are the param's last ones, any leading ones stacked by a repeat)."""
    from tessera.ir.passes.numerics import fp8_weight_uses

    for op, path, name in fp8_weight_uses(graph):
        if op.name == "linear":
            ncon, total = len(op.attrs["over"]), len(op.attrs["over"]) + len(op.attrs["out"])
        elif op.name == "attention":
            ncon, total = (2 if name == "o" else 1), 3
        else:  # mlp, and moe's experts [.., experts, in, out] (the experts dim is the grouped product's)
            ncon, total = 1, 2
        dims = graph.params[path].type.dims[-total:]
        yield graph.params[path], dims[:ncon], dims[ncon:]


def _block_fp8_problems(t, graph: Graph, span, key) -> list[Diagnostic]:
    """fp8_e4m3 @scale(per_block(N)) compute: fp32 block accumulation, and every fp8 weight's contracted and kept
    sizes multiples of N."""
    n = t.scale.block
    written = f"fp8_e4m3 @scale(per_block({n}))"
    if t.accum is not None and t.accum not in ("fp32", "f32"):
        return [Diagnostic(f"`{written}` accumulates each block's product in fp32; `@accum({t.accum})` is not "
                           "implemented with per-block scaling", span=span, key=key,
                           hint=f"write `{written}` (or `{FP8_COMPUTE} @accum({t.accum})`)")]
    weights = list(_fp8_weights(graph))
    sizes = []
    for p, con, keep in weights:
        for what, dims in (("contracted", con), ("output", keep)):
            if any(d.size is None for d in dims):
                continue
            sizes.append(math.prod(d.size for d in dims))
    g = 0
    for size in sizes:
        g = math.gcd(g, size)
    valid = 1
    while g and g % (valid * 2) == 0 and valid * 2 <= max(n, 1):
        valid *= 2
    for p, con, keep in weights:
        for what, dims in (("contracted", con), ("output", keep)):
            if any(d.size is None for d in dims):
                continue
            size = math.prod(d.size for d in dims)
            if size % n:
                where = f" (declared at {p.span.file}:{p.span.line}:{p.span.col})" if p.span else ""
                shown = "×".join(str(d) for d in dims)
                return [Diagnostic(f"`{written}`: parameter `{p.path}`{where} has {what} dim{'s' if len(dims) > 1 else ''} "
                                   f"{shown} = {size}, not a multiple of the block {n} (activations are scaled in "
                                   f"1×{n} blocks along the contracted dims, weights in {n}×{n} blocks)",
                                   span=span, key=key,
                                   hint=f"N = {valid} divides every fp8 product's contracted and output sizes: write "
                                        f"`fp8_e4m3 @scale(per_block({valid}))`")]
    return []


def _at(op) -> str:
    return f" at {op.span.file}:{op.span.line}:{op.span.col}" if op.span else ""


def _delayed_fp8_problems(exp, t, graph: Graph, span, key) -> list[Diagnostic]:
    """fp8_e4m3 @scale(delayed(H)): every fp8 weight is read by one product a step, so its amax history gets one
    entry a step: each is read by one op, outside weight-shared repeats, loops and derivative regions (a stacked
    repeat's layers each have their own history); a model trained on loss entries is refused (its train step does
    not carry the histories)."""
    from tessera.ir.passes.numerics import fp8_product, rule_fp8_ops

    written = f"fp8_e4m3 @scale({t.scale})"
    if graph.losses:
        return [Diagnostic(f"`{written}`: the amax histories are carried by the cross-entropy train step; a model "
                           f"with loss entries (`{graph.losses[0].name}`) is not trained with them",
                           span=span, key=key, hint=f"write `{FP8_COMPUTE}` (current scaling) for this model")]
    readers: dict[str, list] = {}
    fp8_ops = rule_fp8_ops(graph, exp.numerics)  # numerics.compute's choices

    def walk(region, around):
        for op in region.ops:
            for ref in op.operands:
                if getattr(ref, "path", None) in graph.params and fp8_product(op, ref.path.rsplit("/", 1)[-1], fp8_ops):
                    readers.setdefault(ref.path, []).append((op, around))
            if op.region is not None:
                stacked = op.name == "repeat" and op.attrs.get("axis") is not None and op.attrs.get("grad") != "last"
                walk(op.region, around if stacked else around + [op])
            if op.second is not None:
                walk(op.second, around + [op])

    walk(graph.body, [])
    for path, uses in readers.items():
        op, around = uses[0]
        if len(uses) > 1:
            return [Diagnostic(f"`{written}`: weight `{path}` is read by {len(uses)} products a step (`{op.name}`"
                               f"{_at(op)}, `{uses[1][0].name}`{_at(uses[1][0])}); its one amax history would get "
                               "one entry a step from several tensors", span=span, key=key,
                               hint=f"write `{FP8_COMPUTE}` (current scaling), or give each product its own weight")]
        if around:
            outer = around[-1]
            kind = "the weight-shared `repeat`" if outer.name == "repeat" else f"the `{outer.name}`"
            return [Diagnostic(f"`{written}`: weight `{path}` (`{op.name}`{_at(op)}) is read inside {kind}"
                               f"{_at(outer)}, several times a step; its one amax history would get one entry a "
                               "step from several tensors", span=span, key=key,
                               hint=f"write `{FP8_COMPUTE}` (current scaling) for this model")]
    return []


def check_compute_type(exp, graph: Graph) -> list[Diagnostic]:
    """The compute type (`numerics.default`) is one the lowering computes in: fp32, bf16, fp16, or fp8_e4m3 with
    per-tensor, delayed (amax-history) or per-block scaling (products with weights in fp8, the rest in bf16). Other narrow types are storage formats
    here: a parameter may be held in them (`numerics.rules`), not computed in."""
    t = exp.numerics.default
    span, key = exp.span("numerics.default"), "numerics.default"
    if t.base in COMPUTE_TYPES:
        return []
    if t.base == "fp8_e4m3":
        if t.scale is None:
            return [Diagnostic("fp8 compute with no scale is not implemented: the products with weights run in fp8 "
                               "with one scale per tensor from its current amax (`@scale(per_tensor)`), from an amax "
                               "history (`@scale(delayed)`, `@scale(delayed(H))`) or one per block "
                               "(`@scale(per_block(N))`: 1×N activation blocks, N×N weight blocks)",
                               span=span, key=key, hint=f"write `{FP8_COMPUTE}`" + (" @accum(...)" if t.accum else ""))]
        if t.scale.kind == "per_block":
            problems = _block_fp8_problems(t, graph, span, key)
            if problems:
                return problems
        if t.scale.kind == "delayed":
            problems = _delayed_fp8_problems(exp, t, graph, span, key)
            if problems:
                return problems
        cplx = _first_op(graph, "spectral_conv")
        if cplx is not None:
            where = f" (at {cplx.span.file}:{cplx.span.line}:{cplx.span.col})" if cplx.span else ""
            return [Diagnostic(f"fp8 compute: `spectral_conv`'s products with its mode weights run in complex64, "
                               f"not fp8{where}", span=span, key=key, hint="compute in fp32 or bf16")]
        packed = [glob for glob, r in (exp.numerics.rules or {}).items() if r.base == "mxfp4"]
        if packed:
            return [Diagnostic(f"fp8 compute with mxfp4 parameters (rule `{packed[0]}`): their products run on the "
                               "4-bit values as stored, not in fp8", span=span, key=key,
                               hint="compute in bf16 with mxfp4 experts, or hold the experts in bf16/fp32 for fp8")]
        if exp.mesh.size > 1 and not (exp.parallel.deterministic and exp.task.kind == "train"):
            also = " (and record that amax in its history)" if t.scale.kind == "delayed" else ""
            return [Diagnostic(f"fp8 compute (`@scale({t.scale})`): inside a sharded step (generation, forward, or "
                               "training with parallel.deterministic: false) each device would scale its own block "
                               f"of a tensor by the block's amax, not the tensor's{also}, so the numbers would depend "
                               "on the mesh", span=span, key=key,
                               hint="train with parallel.deterministic: true (each canonical shard runs the whole "
                                    "model), or run on one device")]
        return []
    if t.base == "fp8_e5m2":
        return [Diagnostic("fp8 compute runs the products' inputs in e4m3 and their gradients in e5m2 (the usual "
                           "recipe); `fp8_e5m2` as the compute type is not implemented", span=span, key=key,
                           hint=f"write `{FP8_COMPUTE}`")]
    return [Diagnostic(f"`{t.base}` is a storage format, not a type activations can be computed in",
                       span=span, key=key,
                       hint=f"compute in {', '.join(COMPUTE_TYPES)} (e.g. `bf16 @accum(fp32)`) or `{FP8_COMPUTE}`; "
                            f"parameters can be held in `{t.base}` with numerics.rules")]


SPECTRAL_OPS = ("fft", "ifft", "rfft", "irfft", "spectral_conv")  # transforms in complex64 (lower/ops_spectral.py)


def _complex_op(graph: Graph):
    """The first op computing in complex numbers (a complex result, or a Fourier transform inside), or None."""
    from tessera.ir.passes.rewrite import regions

    return next((op for region, _ in regions(graph) for op in region.ops
                 if op.name in SPECTRAL_OPS or any(r.type.dtype in ("c64", "c128") for r in op.results)), None)


def _first_op(graph: Graph, name: str):
    """The first op called `name` anywhere in the graph, or None."""
    from tessera.ir.passes.rewrite import regions

    return next((op for region, _ in regions(graph) for op in region.ops if op.name == name), None)


# Element types a parameter may be held in as written: plain arrays of their own dtype (fp8 included: one byte
# each, on its grid), mxfp4's packed codes + per-32 scales, or `fp8_e4m3 @scale(per_block(N))`: e4m3 codes plus
# an fp32 scale per N×N block (tessera/lower/reference/fp8_blocks.py; its shape checks: storage.check_packed). fp6/fp4_e2m1 have no XLA array type to hold them
# in, and int8 has no scale to map weights onto its integers, so a rule giving them is refused.
STORAGE_TYPES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "mxfp4", "fp64")
INFERENCE_STORAGE = ("fp8_e4m3", "fp8_e5m2")  # (mxfp4's task check is storage.check_packed's)


def _numeric_problems(t, where: str, span, key: str, *, compute: bool, accum: str = "fp32") -> list[Diagnostic]:
    """What in numeric type `t` no lowering would honour: each a positioned error (message prefixed `where`).
    `accum`: the program's accumulation type (numerics.default's @accum, fp32 when it has none)."""
    out = []
    fp8_compute = compute and t.base == "fp8_e4m3"  # its scale is check_compute_type's
    block_fp8 = not compute and held_name(t) != t.base  # fp8_e4m3 @scale(per_block(N)): FP8Blocks storage
    if t.scale is not None and not (t.base == "mxfp4" and str(t.scale) == "per_block(32)") and not fp8_compute \
            and not block_fp8:
        held = "held" if not compute else "computed"
        out.append(Diagnostic(f"{where}`@scale({t.scale})` is not applied to `{t.base}` "
                              f"{'parameters' if not compute else 'compute'}, so `{t}` would not be the arithmetic "
                              f"done: {t.base} would be {held} unscaled", span=span, key=key,
                              hint="drop @scale (mxfp4 carries its own per_block(32) scales); scaled fp8 weights are "
                                   "`fp8_e4m3 @scale(per_block(128))` in a rule, scaled fp8 compute is "
                                   f"`{FP8_COMPUTE}` as numerics.default"))
    if not compute and t.loss_scale is not None:
        out.append(Diagnostic(f"{where}`@loss_scale({t.loss_scale})` on a rule would not be honoured: the loss is "
                              "scaled once for the whole program", span=span, key=key,
                              hint="write it on numerics.default or as numerics.loss_scale"))
    if compute and t.base == "fp64" and t.accum is not None:
        out.append(Diagnostic(f"{where}fp64 computes and accumulates in fp64; `@accum({t.accum})` would not be "
                              "honoured", span=span, key=key, hint="write fp64 without @accum"))
    if not compute and t.accum is not None and t.accum != accum:
        out.append(Diagnostic(f"{where}the program accumulates in {accum} (numerics.default's @accum); a rule's "
                              f"`@accum({t.accum})` would not be honoured: a rule sets how a parameter is held, "
                              "not how the products reading it accumulate", span=span, key=key,
                              hint=f"write @accum({accum}) or leave @accum out of the rule; set the accumulation "
                                   "in numerics.default"))
    if not compute and t.base not in STORAGE_TYPES:
        why = "no lowering has an array type for it" if t.base != "int8" else "int8 weights need a scale"
        out.append(Diagnostic(f"{where}parameters cannot be held in `{t.base}` yet ({why})", span=span, key=key,
                              hint=f"hold them in {', '.join(STORAGE_TYPES)} (fp8 and mxfp4: for inference)"))
    return out


def check_numerics_take_effect(exp, graph: Graph) -> list[Diagnostic]:
    """Every numeric type and modifier the spec writes is one the program honours; the rest are refused here
    (not ignored, and not failing later in the lowering)."""
    num = exp.numerics
    out = _numeric_problems(num.default, "", exp.span("numerics.default"), "numerics.default", compute=True)
    accum = num.default.accum or "fp32"
    for glob, t in (num.rules or {}).items():
        span = exp.span(f"numerics.rules.{glob}") or exp.span("numerics.rules")
        out += _numeric_problems(t, f"rule `{glob}`: ", span, "numerics.rules", compute=False, accum=accum)
    out += _narrow_accum_training(exp, graph, accum)
    if trains(exp.task):
        for glob, t in (num.rules or {}).items():
            if t.base in INFERENCE_STORAGE and any(fnmatch.fnmatchcase(p, glob) for p in graph.params):
                out.append(Diagnostic(
                    f"rule `{glob}`: parameters held in `{t.base}` are inference storage: training would update "
                    f"fp8 values in place (steps below the fp8 spacing vanish) and keep optimizer state in fp8",
                    span=exp.span(f"numerics.rules.{glob}") or exp.span("numerics.rules"), key="numerics.rules",
                    hint="train with fp32 or bf16 parameters (and `fp8_e4m3 @scale(per_tensor)` compute); "
                         f"hold them in {t.base} for generate, forward and bench forward tasks"))
    return out + _loss_scaling(exp)


def _loss_scaling(exp) -> list[Diagnostic]:
    """Loss scaling (numerics.loss_scale or numerics.default's @loss_scale) runs in the train step
    (tessera/lower/loss_scale.py): refused where there is no train step, where the two places disagree,
    and where the 1F1B pipeline computes gradients outside the scaled backward pass."""
    num = exp.numerics
    written = [(key, text) for key, text, on in [
        ("numerics.loss_scale", str(num.loss_scale), str(num.loss_scale) != "none"),
        ("numerics.default", f"@loss_scale({num.default.loss_scale})", num.default.loss_scale is not None)] if on]
    if not written:
        return []
    key, text = written[0]
    span = exp.span(key)
    kind = getattr(exp.task, "kind", None)
    if kind != "train":
        return [Diagnostic(f"loss scaling `{text}` applies to training; a `{kind}` task computes no gradients, so "
                           "it would not be honoured", span=span, key=key, hint="drop it for this task")]
    if len(written) == 2:
        ls, default = num.loss_scale, num.default.loss_scale
        same = (ls == "dynamic" and default == "dynamic") or \
            (ls.startswith("static(") and default != "dynamic" and float(ls[7:-1]) == float(default))
        if not same:
            return [Diagnostic(f"numerics.loss_scale `{ls}` and numerics.default's `@loss_scale({default})` "
                               "disagree; the loss is scaled one way", span=span, key=key,
                               hint="write loss scaling in one place")]
    if exp.mesh.pp > 1 and exp.parallel.pipeline.schedule == "1f1b":
        return [Diagnostic(f"loss scaling `{text}` is not applied under the 1F1B pipeline schedule (its gradients "
                           "are computed outside the scaled backward pass)", span=span, key=key,
                           hint="use parallel.pipeline.schedule: gpipe, or mesh.pp: 1")]
    return []


# ops whose backward products a narrow @accum does not reach (tessera/lower/reference/accum.py: the grouped
# GEMM's weight gradient sums over each expert's ragged run of tokens, which its emulation does not block)
_NARROW_ACCUM_FORWARD_ONLY = ("moe",)


def _narrow_accum_training(exp, graph: Graph, accum: str) -> list[Diagnostic]:
    """A bf16/fp16 accumulator is honoured for real products only, and in training only where every contraction's
    backward honours it."""
    if accum == "fp32":
        return []
    cplx = _complex_op(graph)
    if cplx is not None:
        where = f" (`{cplx.name}` at {cplx.span.file}:{cplx.span.line}:{cplx.span.col})" if cplx.span else ""
        return [Diagnostic(f"`@accum({accum})` is not honoured by complex products and Fourier transforms, which "
                           f"accumulate in their own complex type{where}", span=exp.span("numerics.default"),
                           key="numerics.default",
                           hint="use @accum(fp32) (or leave @accum out) for models with complex values")]
    if getattr(exp.task, "kind", None) != "train":
        return []
    for name in _NARROW_ACCUM_FORWARD_ONLY:
        op = _first_op(graph, name)
        if op is None:
            continue
        where = f" (`{op.name}` at {op.span.file}:{op.span.line}:{op.span.col})" if op.span else ""
        return [Diagnostic(f"`@accum({accum})` is honoured by the experts' grouped products forward only: "
                           f"their weight gradients would accumulate in fp32{where}; training would not "
                           f"run the arithmetic written", span=exp.span("numerics.default"),
                           key="numerics.default",
                           hint=f"train with @accum(fp32); @accum({accum}) runs for generate and forward "
                                "tasks, and for training models without moe")]
    return []


MAX_CANONICAL = 8  # canonical batch shards per step unless parallel.canonical_shards says: the default's cap


def canonical_shards(batch: int, fixed: int | None = None) -> int:
    """C, deterministic mode's batch shards: `fixed` (parallel.canonical_shards) where the spec sets it, else the
    largest divisor of the batch that is at most MAX_CANONICAL."""
    if fixed is not None:
        return fixed
    return max(d for d in range(1, MAX_CANONICAL + 1) if batch % d == 0)


def canonical_problems(batch: int, devices: int, span: Callable[[str], Span | None],
                       fixed: int | None = None) -> list[Diagnostic]:
    """The batch's canonical shards (`fixed`: parallel.canonical_shards) divide it and split evenly over the mesh's
    devices (at the key that decides, which `span(key)` locates: `Experiment.span`)."""
    if fixed is not None and batch % fixed:
        return [Diagnostic(f"parallel.canonical_shards = {fixed} does not divide the batch of {batch}",
                           span=span("parallel.canonical_shards"), key="parallel.canonical_shards",
                           hint=f"use a divisor of {batch} that the mesh's device count divides")]
    c = canonical_shards(batch, fixed)
    if c % devices == 0:
        return []
    if fixed is not None:
        fits = [d for d in range(devices, batch + 1, devices) if batch % d == 0]
        return [Diagnostic(f"deterministic mode cuts the batch of {batch} into {c} canonical shards "
                           f"(parallel.canonical_shards), which do not split over {devices} devices",
                           span=span("parallel.canonical_shards"), key="parallel.canonical_shards",
                           hint=(f"use {fits[0]} (a multiple of {devices} dividing the batch)" if fits else
                                 f"use a batch that {devices} divides") + ", or parallel.deterministic: false")]
    return [Diagnostic(f"deterministic mode cuts the batch of {batch} into {c} canonical shards, which do not split "
                       f"over {devices} devices", span=span("task.batch"), key="task.batch",
                       hint=f"use a batch with {devices} dividing its largest divisor ≤ {MAX_CANONICAL} "
                            f"(e.g. {8 * devices // math.gcd(8, devices)}) on at most {MAX_CANONICAL} "
                            "devices, set parallel.canonical_shards to a multiple of the device count that divides "
                            "the batch, or parallel.deterministic: false")]


def check_canonical_batch(exp, graph: Graph) -> list[Diagnostic]:
    """Deterministic mode: the task's batch splits into canonical shards that the mesh's devices share evenly (the
    rule the sharded step applies, checked before anything compiles); a set parallel.canonical_shards divides the
    batch on any mesh, one device included."""
    batch = getattr(exp.task, "batch", None)
    mesh = getattr(exp, "mesh", None)
    fixed = exp.parallel.canonical_shards
    if not exp.parallel.deterministic or not isinstance(batch, int) or mesh is None:
        return []
    devices = 1 if mesh.auto or mesh.size <= 1 else mesh.size
    if devices == 1 and fixed is None:
        return []
    return canonical_problems(batch, devices, exp.span, fixed)


def _canonical_chunk_problems(exp, graph: Graph, axis: str, ops: tuple[str, ...], dims: tuple[str, ...],
                              what: str, first_only: bool = False) -> list[Diagnostic]:
    """parallel.canonical_<axis> (deterministic mode) cuts the dims named `dims` of the parameters the `ops` read into
    that many chunks: each must split evenly (every such dim named, or the first where `first_only`), and the
    products must not be fp8 (each chunk of `what` would be scaled by its own amax)."""
    key = f"parallel.canonical_{axis}"
    chunks = getattr(exp.parallel, f"canonical_{axis}")
    if not exp.parallel.deterministic or chunks is None or chunks <= 1:
        return []
    where = dict(span=exp.span(key), key=key)
    if str(exp.numerics.default.base).startswith("fp8"):
        return [Diagnostic(f"{key} = {chunks} with fp8 compute ({exp.numerics.default}) is not supported: each "
                           f"chunk of {what} would be scaled by its own amax", **where,
                           hint=f"remove {key} ({axis} then acts as a data axis) or compute in bf16")]
    out, seen = [], set()
    for op in graph.body.walk():
        if op.name not in ops:
            continue
        for o in op.operands:
            if not isinstance(o, ParamRef) or o.path in seen or o.path not in graph.params:
                continue
            seen.add(o.path)
            for d in graph.params[o.path].type.dims:
                if d.name in dims and d.size % chunks:
                    out.append(Diagnostic(f"{key} = {chunks} does not divide {o.path}'s {d.name} ({d.size}), which "
                                          f"deterministic {axis} cuts into that many chunks", **where,
                                          hint=f"use a power of two dividing {d.size}"))
    return out[:1] if first_only else out


def check_canonical_tp(exp, graph: Graph) -> list[Diagnostic]:
    """parallel.canonical_tp cuts the attention's heads and the MLP's and experts' hidden dim of every attention, mlp
    and moe op into that many chunks (tessera/lower/shard/det_tensor.py)."""
    return _canonical_chunk_problems(exp, graph, "tp", ("attention", "mlp", "moe"), ("heads", "kv_heads", "mlp"),
                                     "a product")


def check_canonical_ep(exp, graph: Graph) -> list[Diagnostic]:
    """parallel.canonical_ep cuts every moe op's experts into that many chunks (tessera/lower/shard/det_expert.py;
    with parallel.canonical_tp as well, each chunk's hidden dim into canonical_tp chunks)."""
    return _canonical_chunk_problems(exp, graph, "ep", ("moe",), ("experts",), "experts", first_only=True)


def check_whole_dims(exp, graph: Graph) -> list[Diagnostic]:
    """No mesh axis splits a dim an op needs whole (`OpDef.whole_dims`: a Fourier transform's): refused here,
    naming the op, the dim and the axis, rather than gathered silently."""
    from tessera.ir.passes.shard import AxisRules
    from tessera.ir.registry import get_op

    rules = AxisRules.from_experiment(exp)
    sizes, out, seen = dict(rules.sizes), [], set()
    for op in graph.body.walk():
        need = get_op(op.name).whole_dims if get_op(op.name) else None
        for name in (need(op.attrs) if need else ()):
            axes = tuple(a for a in rules.dims((name,), activation=True)[0] if sizes.get(a, 1) > 1)
            if not axes or (op.name, name) in seen:
                continue
            seen.add((op.name, name))
            key = f"mesh.{axes[-1]}"
            out.append(Diagnostic(
                f"`{op.name}` transforms `{name}` whole on each device, but {' × '.join(f'{a}={sizes[a]}' for a in axes)} "
                f"splits `{name}` (parallel.rules)", span=exp.span(key), key=key,
                hint=f"keep `{name}` unsplit: drop it from parallel.rules, or use a mesh without {' × '.join(axes)}"))
    return out


def check_objectives(exp, graph: Graph) -> list[Diagnostic]:
    """A model with `loss` entries: the spec's loss weights name its terms, its data feeds every loss input, and
    it runs on one device; a model without them (cross-entropy) takes no loss weights."""
    from tessera.ir.check_objectives import objective_problems

    return objective_problems(exp, graph)


def check_compute_rules(exp, graph: Graph) -> list[Diagnostic]:
    """Each `numerics.compute` rule names ops whose products can run in fp8 and a type that takes effect there
    (tessera/ir/check_compute.py)."""
    from tessera.ir.check_compute import compute_rule_problems

    return compute_rule_problems(exp, graph)


CHECKS = [check_mesh_divides, check_canonical_batch, check_canonical_tp, check_canonical_ep, check_numeric_rules,
          check_compute_type, check_compute_rules, check_numerics_take_effect, check_whole_dims, check_objectives]


def experiment_graph(exp) -> Graph:
    """The experiment's model elaborated and verified, errors pointing into the spec where args come from."""
    from tessera.ir.elaborate import build_graph

    return build_graph(exp.model.file, dict(exp.model.args), arg_span=lambda n: exp.span(f"model.args.{n}"),
                       arg_key_span=lambda n: exp.key_span(f"model.args.{n}"))


def check_experiment(exp) -> Graph:
    """Elaborate exp's model, run the pipeline, and run CHECKS; raise TesseraError listing all problems."""
    from tessera.ir.passes import PassContext, run_pipeline

    graph = experiment_graph(exp)
    problems = [d for check in CHECKS for d in check(exp, graph)]
    if problems:
        raise TesseraError(problems)
    return run_pipeline(graph, ctx=PassContext.of(exp))
