"""Logical axes → mesh axes for the lowering: the IR's AxisRules plus the PartitionSpecs shard_map takes."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from tessera.ir.passes.shard import PRIORITY, AxisRules, shard_label

__all__ = ["PRIORITY", "AxisRules", "annotated_axes", "partition_spec", "shard_label", "spec_of"]


def spec_of(axes: tuple[tuple[str, ...], ...]) -> P:
    """The PartitionSpec of mesh axes per dim (one entry per dim: None, an axis, or a tuple of axes)."""
    return P(*[None if not a else a[0] if len(a) == 1 else a for a in axes])


def partition_spec(rules: AxisRules, names: tuple[str, ...], *, activation: bool = False) -> P:
    """The PartitionSpec the rules give a tensor with dims `names`."""
    return spec_of(rules.dims(names, activation=activation))


def annotated_axes(t) -> tuple[tuple[str, ...], ...]:
    """Mesh axes per dim of a type as the `shard` pass annotated it (`tp` -> ("tp",), `dp*fsdp`, `-` -> ()).

    The lowering places parameters by these annotations, so the graph that runs is the one `tessera ir
    --after shard` prints (and an edited annotation is what runs)."""
    if t.dims and t.shard is None:
        raise ValueError(f"type {t} carries no shard annotation: run the compiler's pipeline (its `shard` pass)")
    return tuple(tuple(a.split("*")) if a else () for a in (t.shard or ()))
