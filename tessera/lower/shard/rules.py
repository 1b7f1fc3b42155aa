"""Logical axes → mesh axes for the lowering: the IR's AxisRules plus the PartitionSpecs shard_map takes."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from tessera.ir.passes.shard import PRIORITY, AxisRules, shard_label

__all__ = ["PRIORITY", "AxisRules", "partition_spec", "shard_label"]


def partition_spec(rules: AxisRules, names: tuple[str, ...], *, activation: bool = False) -> P:
    """The PartitionSpec of a tensor with dims `names` (one entry per dim: None, an axis, or a tuple)."""
    return P(*[None if not a else a[0] if len(a) == 1 else a for a in rules.dims(names, activation=activation)])
