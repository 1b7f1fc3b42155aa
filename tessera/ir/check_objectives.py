"""Checks of a scientific model against its spec: loss weights, collocation data and the model's inputs agree."""

from __future__ import annotations

from tessera.diagnostics import Diagnostic, did_you_mean
from tessera.ir.types import Graph, is_float


SCIENTIFIC_DATA = ("collocation", "burgers")  # the data kinds that feed `loss` entries only
LOSS_DATA = SCIENTIFIC_DATA + ("sudoku",)  # ... and those that feed them or a model's cross-entropy
BATCHED_DATA = ("burgers", "sudoku")  # ... in batches of samples: deterministic mode trains on canonical shards of them
SUDOKU_FEEDS = {"tokens": "puzzles", "targets": "solutions", "mask": "ones"}  # a batch of sudoku data, by name


def batched_data(exp) -> bool:
    """Whether the task feeds loss entries batches of samples (burgers pairs), which deterministic mode cuts into
    canonical shards; collocation points (a PINN's) are one objective over every point."""
    return getattr(getattr(exp.task, "data", None), "kind", None) in BATCHED_DATA


def _pairs_problems(exp, graph: Graph, data) -> list[Diagnostic]:
    """burgers data gives `u0` and `u1` [pairs, resolution]: loss inputs must be those, of that many points."""
    out = []
    for loss in graph.losses:
        for a in loss.region.args:
            if a.name not in ("u0", "u1"):
                out.append(Diagnostic(f"loss `{loss.name}` takes input `{a.name}`; burgers data gives `u0` (initial "
                                      "conditions) and `u1` (solutions at t = 1)", span=exp.span("task.data.kind"),
                                      key="task.data.kind", hint=did_you_mean(a.name, ["u0", "u1"])))
    for v in [a for loss in graph.losses for a in loss.region.args] + list(graph.inputs):
        if v.type.dims and v.type.dims[-1].size not in (None, data.resolution):
            out.append(Diagnostic(f"`{v.name}` is {v.type}, but the data has {data.resolution} points per function",
                                  span=exp.span("task.data.resolution") or exp.span("task.data"),
                                  key="task.data.resolution", hint=f"use resolution: {v.type.dims[-1].size}"))
    return out


def _sudoku_problems(exp, graph: Graph) -> list[Diagnostic]:
    """sudoku data gives int tokens [batch, 81] and reads a cell's digit from logits over ids 1-9: the model takes
    one integer input of 81 positions (or of a size known at run time) and its logits cover ids 0-9."""
    out, span = [], exp.span("task.data.kind")
    x = graph.inputs[0]
    if len(graph.inputs) != 1 or is_float(x.type.dtype) or len(x.type.dims) != 2 or \
            x.type.dims[1].size not in (None, 81):
        out.append(Diagnostic(f"sudoku data gives int tokens [batch, 81], but model `{graph.name}` takes "
                              + ", ".join(f"`{v.name}` {v.type}" for v in graph.inputs), span=span, key="task.data.kind",
                              hint="declare forward(tokens: i32[batch, seq = 81])"))
    y = graph.outputs[0].type
    vocab = y.dims[-1].size if y.dims else None
    if vocab is None or vocab < 10:
        out.append(Diagnostic(f"a Sudoku cell's digit is the argmax of logits over ids 1-9, but model "
                              f"`{graph.name}` returns {y}", span=span, key="task.data.kind",
                              hint="give the model a vocabulary of at least 10 (0 = blank, 1-9 = digits)"))
    return out


def _sudoku_loss_problems(exp, graph: Graph) -> list[Diagnostic]:
    """sudoku data gives `tokens` and `targets` (int) and `mask` (float), each [batch, 81], to loss entries by name;
    the forward reads puzzles as a model without loss entries does (`tessera.load_run`'s contract)."""
    out, span = _sudoku_problems(exp, graph), exp.span("task.data.kind")
    for loss in graph.losses:
        for a in loss.region.args:
            if a.name not in SUDOKU_FEEDS:
                out.append(Diagnostic(f"loss `{loss.name}` takes input `{a.name}`; sudoku data gives "
                                      + ", ".join(f"`{k}` ({v})" for k, v in SUDOKU_FEEDS.items()), span=span,
                                      key="task.data.kind", hint=did_you_mean(a.name, list(SUDOKU_FEEDS))))
            elif len(a.type.dims) != 2 or a.type.dims[1].size not in (None, 81) or \
                    is_float(a.type.dtype) != (a.name == "mask"):
                want = "f32" if a.name == "mask" else "i32"
                out.append(Diagnostic(f"loss `{loss.name}` input `{a.name}` is {a.type}, but sudoku data gives "
                                      f"{want}[batch, 81]", span=span, key="task.data.kind"))
    return out


def _data_problems(exp, graph: Graph, data) -> list[Diagnostic]:
    if data.kind == "burgers":
        return _pairs_problems(exp, graph, data)
    if data.kind == "sudoku":
        return _sudoku_loss_problems(exp, graph)
    out = []
    coords = len(data.domain)
    feeds = set(data.sets) | {f"{n}_target" for n, s in data.sets.items() if s.target == "exact"}
    for loss in graph.losses:
        for a in loss.region.args:
            if a.name not in feeds:
                out.append(Diagnostic(f"loss `{loss.name}` takes input `{a.name}`, which no point set gives",
                                      span=exp.key_span("task.data.sets") or exp.span("task.data"), key="task.data.sets",
                                      hint=did_you_mean(a.name, sorted(feeds)) or
                                      f"the sets give {', '.join(sorted(feeds))}"))
            elif a.name in data.sets and (not a.type.dims or a.type.dims[-1].size != coords):
                out.append(Diagnostic(f"loss `{loss.name}` input `{a.name}` is {a.type}, but the domain has {coords} "
                                      f"coordinates ({', '.join(data.domain)}); its last dim must be of size {coords}",
                                      span=exp.span("task.data.domain"), key="task.data.domain"))
    for v in graph.inputs:
        if v.type.dims and v.type.dims[-1].size not in (None, coords):
            out.append(Diagnostic(f"the model's input `{v.name}` is {v.type}, but the domain has {coords} coordinates",
                                  span=exp.span("task.data.domain"), key="task.data.domain"))
    return out


def _no_fp64(exp, graph: Graph) -> list[Diagnostic]:
    """fp64 turns on jax_enable_x64 for the whole process; it is for models with loss entries only, for now."""
    num = exp.numerics
    found = [("numerics.default", num.default), ("numerics.params", num.params)]
    found += [(f"numerics.rules.{glob}", t) for glob, t in (num.rules or {}).items()]
    return [Diagnostic(f"fp64 is for models with `loss` entries (scientific models); model `{graph.name}` trains "
                       "on cross-entropy", span=exp.span(key) or exp.span("numerics.rules"),
                       key="numerics.rules" if ".rules." in key else key, hint="use fp32, bf16 or fp16")
            for key, t in found if t.base == "fp64"]


def objective_problems(exp, graph: Graph) -> list[Diagnostic]:
    """Positioned problems of loss weights, data and mesh for `graph`'s loss entries."""
    task = exp.task
    weights = getattr(task, "loss_weights", None) or {}
    data = getattr(task, "data", None)
    out = []
    if not graph.losses:
        out += _no_fp64(exp, graph)
        for name in weights:
            out.append(Diagnostic(f"model `{graph.name}` names no loss terms (it trains on next-token cross-entropy)",
                                  span=exp.key_span(f"task.loss_weights.{name}"), key=f"task.loss_weights.{name}"))
        opt = getattr(task, "optimizer", None)
        if opt is not None and (opt.name == "lbfgs" or opt.lbfgs_after is not None):
            key = "task.optimizer.name" if opt.name == "lbfgs" else "task.optimizer.lbfgs_after"
            out.append(Diagnostic("L-BFGS needs a deterministic objective over fixed points: it trains models with "
                                  f"`loss` entries, and model `{graph.name}` has none", span=exp.span(key), key=key,
                                  hint="use adamw, adam or sgd for a language model"))
        if task.kind == "train" and getattr(data, "kind", None) == "sudoku":
            out += _sudoku_problems(exp, graph)
        if getattr(data, "kind", None) in SCIENTIFIC_DATA:
            out.append(Diagnostic(f"{data.kind} data feeds `loss` entries, and model `{graph.name}` has none",
                                  span=exp.span("task.data.kind"), key="task.data.kind",
                                  hint="use synthetic or tokens data for a language model"))
        return out
    terms = graph.terms
    for name, w in weights.items():
        if name not in terms:
            out.append(Diagnostic(f"model `{graph.name}` has no loss term `{name}` (terms: {', '.join(terms)})",
                                  span=exp.key_span(f"task.loss_weights.{name}"), key=f"task.loss_weights.{name}",
                                  hint=did_you_mean(name, terms)))
        elif not w >= 0:
            out.append(Diagnostic(f"loss weight of `{name}` must be 0 or more, got {w}",
                                  span=exp.span(f"task.loss_weights.{name}"), key=f"task.loss_weights.{name}"))
    if task.kind == "train" and getattr(data, "kind", None) not in LOSS_DATA:
        out.append(Diagnostic(f"model `{graph.name}` names loss terms ({', '.join(terms)}): it trains on collocation "
                              f"points, burgers pairs or sudoku puzzles, not `{getattr(data, 'kind', None)}` data",
                              span=exp.span("task.data.kind") or exp.span("task"), key="task.data.kind",
                              hint="write data: {kind: collocation, domain: ..., sets: ...}"))
    elif task.kind == "train":
        out += _data_problems(exp, graph, data)
    if task.kind != "train":
        out.append(Diagnostic(f"model `{graph.name}` is a scientific model (loss entries): task `{task.kind}` is for "
                              "language models", span=exp.span("task.kind"), key="task.kind",
                              hint="train it, then evaluate it with tessera.load_run"))
    if batched_data(exp) and exp.parallel.deterministic:
        out += _batch_mean_problems(graph)
    if exp.mesh.size > 1 and not batched_data(exp):
        out.append(Diagnostic("models with loss entries on collocation points run on one device for now",
                              span=exp.span("mesh"), key="mesh", hint="remove the mesh section"))
    elif exp.mesh.size > 1 and not exp.parallel.deterministic:
        out.append(Diagnostic("models with loss entries run on a mesh in deterministic mode only (canonical batch "
                              "shards, whole params on each device)", span=exp.span("parallel.deterministic"),
                              key="parallel.deterministic", hint="set parallel.deterministic: true"))
    return out


def _mixes(op, dim: str) -> bool:
    """Whether `op` combines values across `dim`: an attribute names it, or it drops it from an operand."""
    def names_dim(v) -> bool:
        if isinstance(v, (tuple, list)):
            return any(names_dim(x) for x in v)
        return getattr(v, "name", None) == dim and not isinstance(v, str)

    if any(names_dim(v) for v in op.attrs.values()):
        return True
    return any(dim in v.type.names for v in op.values) and any(dim not in r.type.names for r in op.results)


def _batch_mean_problems(graph: Graph) -> list[Diagnostic]:
    """Deterministic mode averages each loss term over canonical shards of the batch, which is the term over the
    whole batch only for a mean over the batch of per-sample values: each term must be `mean(..., over = [batch])`
    (batch: the loss inputs' first dim) of values no other op combines across samples."""
    out = []
    for loss in graph.losses:
        dims = {a.type.dims[0].name for a in loss.region.args if a.type.dims}
        if len(dims) != 1:
            out.append(Diagnostic(f"loss `{loss.name}`'s inputs must share their first dim (the batch of samples), "
                                  f"got {', '.join(str(a.type) for a in loss.region.args)}", span=loss.span))
            continue
        (dim,) = dims
        finals = {id(v) for v in loss.region.outputs}
        for op in loss.region.walk():
            if not _mixes(op, dim):
                continue
            term = op.name == "mean" and [d.name for d in op.attrs["over"]] == [dim] and id(op.result) in finals
            if not term:
                out.append(Diagnostic(f"`{op.name}` combines values across `{dim}`: deterministic mode averages each "
                                      f"loss term over canonical shards of the batch, so a term must be "
                                      f"`mean(..., over = [{dim}])` of per-sample values", span=op.span,
                                      hint="return the mean over the batch of a per-sample value, or set "
                                           "parallel.deterministic: false on one device"))
    return out
