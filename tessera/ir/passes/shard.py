"""The `shard` pass: a ShardSpec (mesh axes per dim) on every parameter and value, from `parallel.rules`.

Logical axes → mesh axes is the one table `parallel.rules` gives, applied to every dim of every type.
A dim's mesh axes are its rule's axes of size > 1 (size-1 axes split nothing). Within one tensor a mesh
axis splits at most one dim: dims claim axes in priority order (batch first, so activations
[batch, seq, embed] are split on batch by dp×fsdp and keep embed whole, while a parameter
[embed, heads, head_dim] is split on embed by fsdp: ZeRO-3 sharding, gathered before use).
Printed per dim: `tp`, `dp*fsdp` or `-` (`tessera ir SPEC --after shard`).
"""

from __future__ import annotations

import dataclasses

from tessera.ir.passes import PassContext, register_pass
from tessera.ir.types import Graph, Region

# which dim claims a contested mesh axis first
PRIORITY = ("batch", "layers", "experts", "heads", "kv_heads", "mlp", "vocab", "seq", "embed", "head_dim")


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """The active rules: logical axis → mesh axes of size > 1, and the mesh axis sizes."""

    rules: tuple[tuple[str, tuple[str, ...]], ...]
    sizes: tuple[tuple[str, int], ...]
    sequence_parallel: bool = False

    @classmethod
    def from_experiment(cls, exp) -> "AxisRules":
        """The rules of exp's parallel section on exp's mesh (size-1 mesh axes dropped)."""
        sizes = dict(exp.mesh.axes)
        active = []
        for logical, rule in exp.parallel.rules.items():
            axes = () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)
            axes = tuple(a for a in axes if sizes[a] > 1)
            if axes:
                active.append((logical, axes))
        if "layers" not in exp.parallel.rules and sizes.get("pp", 1) > 1:
            active.append(("layers", ("pp",)))  # pipeline stages split the stacked layers unless a rule says else
        return cls(tuple(active), tuple(sizes.items()), bool(exp.parallel.sequence_parallel))

    def axes(self, logical: str) -> tuple[str, ...]:
        """The mesh axes splitting `logical` (empty when replicated)."""
        return dict(self.rules).get(logical, ())

    def context_axes(self) -> tuple[str, ...]:
        """Mesh axes splitting seq for the whole network (context parallelism): seq's rule less the axes batch
        claims first. Megatron sequence parallelism (`sequence_parallel`) splits seq over the heads' axes
        between blocks only, and is not among them."""
        batch = self.axes("batch")
        return tuple(a for a in self.axes("seq") if a not in batch)

    def size(self, axes) -> int:
        """How many ways `axes` split a dim."""
        sizes, n = dict(self.sizes), 1
        for a in axes:
            n *= sizes[a]
        return n

    def ways(self, logical: str) -> int:
        """How many ways the rules split `logical`."""
        return self.size(self.axes(logical))

    def dims(self, names: tuple[str, ...], *, activation: bool = False) -> tuple[tuple[str, ...], ...]:
        """Mesh axes per dim of a tensor with dims `names`; each mesh axis used once, by priority."""
        taken: set[str] = set()
        out: dict[int, tuple[str, ...]] = {}
        order = sorted(range(len(names)), key=lambda i: _rank(names[i]))
        for i in order:
            want = self.axes(names[i])
            if activation and names[i] == "seq" and self.sequence_parallel:
                want = want + self.axes("heads")  # Megatron SP: activations between blocks split seq by tp
            if activation and names[i] in ("embed", "head_dim"):
                want = ()  # activations keep the model dim whole; only parameters shard it (ZeRO-3)
            got = tuple(a for a in want if a not in taken)
            taken.update(got)
            out[i] = got
        return tuple(out[i] for i in range(len(names)))

    def local_shape(self, names: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
        """Per-device shape of a parameter with dims `names` and global `shape`."""
        return tuple(n // self.size(a) for n, a in zip(shape, self.dims(names)))


def _rank(name: str) -> int:
    return PRIORITY.index(name) if name in PRIORITY else len(PRIORITY)


def shard_label(axes: tuple[str, ...]) -> str | None:
    """How the IR prints one dim's mesh axes: `tp`, `dp*fsdp`, or None (replicated)."""
    return "*".join(axes) if axes else None


def _annotate(t, rules: AxisRules, activation: bool):
    if not t.dims:
        return t  # scalars (the layer index) have nothing to split
    return dataclasses.replace(t, shard=tuple(shard_label(a) for a in rules.dims(t.names, activation=activation)))


def _annotate_region(region: Region, rules: AxisRules, seen: set) -> None:
    values = list(region.args) + [v for op in region.ops for v in op.results]
    for v in values:
        if id(v) not in seen:
            seen.add(id(v))
            v.type = _annotate(v.type, rules, activation=True)
    for op in region.ops:
        for inner in (op.region, op.second):
            if inner is not None:
                _annotate_region(inner, rules, seen)


def shard(graph: Graph, ctx: PassContext) -> Graph:
    """Every param and value of `graph` annotated with its mesh axes on the experiment's mesh."""
    if ctx is None or ctx.rules is None:
        return graph
    rules = ctx.rules
    for p in graph.params.values():
        p.type = _annotate(p.type, rules, activation=False)
    seen: set = set()
    whole_seq = dataclasses.replace(rules, sequence_parallel=False)  # token inputs arrive whole along seq
    for v in graph.inputs:
        seen.add(id(v))
        v.type = _annotate(v.type, whole_seq, activation=True)
    _annotate_region(graph.body, rules, seen)
    return graph


register_pass("shard", shard)
