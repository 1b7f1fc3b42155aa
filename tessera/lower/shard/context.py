"""Context parallelism (fast mode): activations split along `seq` over the `sp` axis for the whole network.

Each device holds tokens [b/dp, s/sp] (and [b/dp, s/(sp·tp)] between blocks under Megatron sequence
parallelism). Per-token ops run on their block unchanged; attention rotates its queries and keys at global
positions, all-gathers K and V over sp (Llama-3 style all-gather context parallelism) and masks with the
queries' offset; the loss sums are psum'd over sp with the batch axes; parameters are replicated over sp,
so their gradients are psum'd over sp (the transpose of shard_map's implicit broadcast). Generation runs
with seq unsplit: sp then replicates the decode (see docs/parallel.md).

This file holds what the plan checks and the token PartitionSpec; the lowerings use `ShardEnv`'s
`context_axes`, `seq_start` and `context_gather` (collectives.py).
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from tessera.diagnostics import error
from tessera.lower.options import CompileOptions
from tessera.lower.shard.rules import AxisRules

# logical axes whose mesh axes a context axis must not share (their lowerings assume seq is whole there)
COMPUTE_AXES = ("heads", "kv_heads", "mlp", "vocab", "experts", "layers", "embed")


def context_axes(rules: AxisRules) -> tuple[str, ...]:
    """Mesh axes splitting seq for the whole network (`AxisRules.context_axes`)."""
    return rules.context_axes()


def token_spec(rules: AxisRules, ndim: int = 2) -> P:
    """PartitionSpec of a per-token array [batch, seq, ...]: batch over the batch axes, seq over the context axes."""
    def entry(axes):
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return P(entry(rules.axes("batch")), entry(context_axes(rules)), *([None] * (ndim - 2)))


def check_context(options: CompileOptions) -> None:
    """Fast mode: context axes split nothing else, and the activation seq split divides task.seq_len."""
    rules = options.rules
    ctx = context_axes(rules)
    for axis in ctx:
        shared = [name for name in COMPUTE_AXES if axis in rules.axes(name)]
        if shared:
            raise error(f"context parallelism over `{axis}` is not supported when `{axis}` also splits "
                        f"`{shared[0]}`", span=options.span("parallel.rules.seq"), key="parallel.rules.seq",
                        hint="map seq to the sp axis alone (the default), and give sp no other rule")
    seq_len = options.seq_len
    split = rules.dims(("batch", "seq", "embed"), activation=True)[1]
    n = rules.size(split)
    if isinstance(seq_len, int) and n > 1 and seq_len % n:
        shown = "×".join(f"{a}={dict(rules.sizes)[a]}" for a in split)
        raise error(f"activations split seq over {shown} = {n} ways, which does not divide seq_len={seq_len}",
                    span=options.span("task.seq_len"), key="task.seq_len",
                    hint=f"use a seq_len that is a multiple of {n}")
