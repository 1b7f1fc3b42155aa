"""Collectives the sharded lowerings use, chosen from the shard rules; a no-op on one device.

Inside `shard_map` each lowering sees its local block. `ShardEnv` answers which mesh axes split a
logical axis and performs the collectives: parameters are all-gathered along the dims their op does
not handle natively (`OpDef.native_split`; FSDP's embed: gathered per layer inside the scan; the
transpose reduce-scatters the gradients), contractions over a split axis are psum'd (psum_scatter
along seq with sequence parallelism), and sequence-parallel activations are all-gathered along seq
before a block.
Under context parallelism (seq over `sp`) every activation is a block of the sequence; attention
all-gathers K and V over sp and places its queries at their global positions.
Deterministic mode's exact gathers live here too (`gather_full`, `local_block`, `as_bits`): a block's bit patterns
summed as integers where one device holds each element.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tessera.ir.registry import get_op
from tessera.lower.shard.context import context_axes
from tessera.lower.shard.rules import AxisRules


def vma(x) -> tuple[str, ...]:
    """The mesh axes x varies along, sorted (jax's vma; on jax 0.10 the set lives on the manual axis type)."""
    t = jax.typeof(x)
    have = getattr(t, "vma", None)
    if have is None:
        have = getattr(getattr(t, "manual_axis_type", None), "varying", frozenset())
    return tuple(sorted(have))


def varying(x, axes: tuple[str, ...]):
    """x marked as differing per device along `axes` (jax's vma; a no-op where it already does)."""
    have = vma(x)
    missing = tuple(a for a in axes if a not in have)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def native_axes(op: str, name: str) -> tuple[str, ...]:
    """The logical axes op's lowering handles split for its parameter `name` (its `OpDef.native_split`);
    every other split dim is gathered at use."""
    for glob, axes in get_op(op).native_split:
        if fnmatch.fnmatch(name, glob):
            return axes
    return ()


def block_index(axes: tuple[str, ...]):
    """This device's block index along a dim split over `axes` (0 when none)."""
    idx = 0
    for a in axes:  # row-major over the listed axes, as shard_map lays blocks out
        idx = idx * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return idx


# ---- exact gathers of blocks (deterministic mode): bit patterns summed where one device holds each element ------

def _entries(spec: P):
    return [(i, e) for i, e in enumerate(spec) if e is not None]


def gather_full(x, spec: P):
    """The whole tensor from this device's block, in the layout a one-device program holds it.

    Each device places its block's bit patterns in a zero tensor of the whole shape and the blocks are summed as
    integers (exact: one device contributes each element's bits, and -0.0 stays -0.0). Not `all_gather`: XLA
    lays an all-gather along a minor dim out with that dim major (the spectral MoE's experts {4,3,2,0,1}), and
    the products reading it then summed in another order than one device's, so ep=2 was not bit-identical
    (bench/experiments/mesh_divergence.py)."""
    for i, e in _entries(spec):
        axes = (e,) if isinstance(e, str) else tuple(e)
        n = math.prod(jax.lax.axis_size(a) for a in axes)
        bits, wide = as_bits(x)
        full = jnp.zeros(x.shape[:i] + (x.shape[i] * n,) + x.shape[i + 1:], wide.dtype)
        full = jax.lax.dynamic_update_slice_in_dim(full, wide, block_index(axes) * x.shape[i], axis=i)
        x = jax.lax.bitcast_convert_type(jax.lax.psum(full, e).astype(bits.dtype), x.dtype)
    return x


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}  # a dtype's bit pattern, by its item size


def as_bits(x):
    """(x's bit pattern as the unsigned integer of its width, that widened to 32 or 64 bits): what a psum adds
    exactly where one device holds each element's bits and the others zeros."""
    bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])
    return bits, bits.astype(jnp.uint64 if x.dtype.itemsize == 8 else jnp.uint32)


def from_owner(x, mine, axes):
    """x's bits from the device where `mine` holds (a predicate broadcast against x: per element, or one for all),
    zeros elsewhere, summed as integers over `axes`: exact where one device owns each element (-0.0 kept)."""
    bits, wide = as_bits(x)
    summed = jax.lax.psum(jnp.where(mine, wide, jnp.zeros_like(wide)), axes)
    return jax.lax.bitcast_convert_type(summed.astype(bits.dtype), x.dtype)


def local_block(x, spec: P):
    """This device's block of a whole tensor."""
    for i, e in _entries(spec):
        axes = (e,) if isinstance(e, str) else tuple(e)
        size = x.shape[i] // math.prod(jax.lax.axis_size(a) for a in axes)
        x = jax.lax.dynamic_slice_in_dim(x, block_index(axes) * size, size, axis=i)
    return x


@dataclasses.dataclass(frozen=True)
class ShardEnv:
    """The rules, each parameter's dims and annotated mesh axes, and the expert capacity."""

    rules: AxisRules
    param_dims: tuple[tuple[str, tuple[str, ...]], ...]
    expert_capacity: float | None = None  # parallel.expert_capacity (expert.py); None: dropless
    param_axes: tuple = ()  # (path, mesh axes per dim): the IR's shard annotations, where the params are placed

    def axes(self, logical: str) -> tuple[str, ...]:
        """Mesh axes splitting `logical` (empty: replicated)."""
        return self.rules.axes(logical)

    def ways(self, logical: str) -> int:
        return self.rules.ways(logical)

    def index(self, logical: str):
        """This device's block index along `logical` (0 when not split)."""
        return block_index(self.axes(logical))

    @property
    def context_axes(self) -> tuple[str, ...]:
        """Axes splitting activations' seq for the whole network (context parallelism over `sp`)."""
        return context_axes(self.rules)

    def seq_start(self, local_len: int):
        """Global position of this device's first token, its context block holding `local_len` tokens."""
        axes = self.context_axes
        return block_index(axes) * local_len if axes else 0

    def context_gather(self, x, axis: int = 1):
        """A context block [b, s/sp, ...] made whole along seq [b, s, ...] (transpose: reduce-scatter)."""
        axes = self.context_axes
        return jax.lax.all_gather(x, axes, axis=axis, tiled=True) if axes else x

    def whole_seq(self) -> "ShardEnv":
        """This environment with seq unsplit (no context or sequence parallelism): generation's."""
        rules = dataclasses.replace(self.rules, rules=tuple(r for r in self.rules.rules if r[0] != "seq"),
                                    sequence_parallel=False)
        return dataclasses.replace(self, rules=rules)

    @property
    def seq_parallel_axes(self) -> tuple[str, ...]:
        """Axes activations between blocks are split along seq by (Megatron sequence parallelism)."""
        return self.axes("heads") if self.rules.sequence_parallel else ()

    def gather_param(self, op: str, name: str, path: str, w):
        """`w` (local block of param `path`) all-gathered along every split dim op does not handle natively."""
        dims = dict(self.param_dims)[path]
        dims = dims[len(dims) - w.ndim:]  # inside a repeat the leading `layers` dim is gone
        split = dict(self.param_axes)[path][-w.ndim:] if w.ndim else ()
        keep = native_axes(op, name)
        for i, (dim, axes) in enumerate(zip(dims, split)):
            if axes and dim not in keep:  # an MXFP4 pytree: codes and scales split (and gathered) alike
                w = jax.tree.map(lambda a: jax.lax.all_gather(a, axes, axis=i, tiled=True), w)
        return w

    def psum(self, x, *logical: str):
        """x summed over the mesh axes splitting the given logical axes (a contraction's partials)."""
        axes = tuple(a for name in logical for a in self.axes(name))
        return jax.lax.psum(x, axes) if axes else x

    def gather(self, x, logical: str, axis: int):
        """x whole along `axis`, the dim `logical` is split over (all_gather)."""
        axes = self.axes(logical)
        return jax.lax.all_gather(x, axes, axis=axis, tiled=True) if axes else x

    def seq_gather(self, x, axis: int = 1):
        """Sequence-parallel activations [b, s/tp, ...] → [b, s, ...]."""
        axes = self.seq_parallel_axes
        return jax.lax.all_gather(x, axes, axis=axis, tiled=True) if axes else x

    def seq_local(self, x, axis: int = 1):
        """This device's block of a whole-sequence activation under sequence parallelism."""
        axes = self.seq_parallel_axes
        if not axes:
            return x
        size = x.shape[axis] // self.rules.size(axes)
        return jax.lax.dynamic_slice_in_dim(x, self.index("heads") * size, size, axis=axis)

    def reduce_out(self, x, *logical: str, axis: int = 1):
        """A block's partial output summed over `logical`'s axes; scattered along seq under sequence parallelism."""
        axes = tuple(a for name in logical for a in self.axes(name))
        if not axes:
            return self.seq_local(x, axis)
        if self.seq_parallel_axes and set(self.seq_parallel_axes) <= set(axes):
            rest = tuple(a for a in axes if a not in self.seq_parallel_axes)
            x = jax.lax.psum(x, rest) if rest else x
            return jax.lax.psum_scatter(x, self.seq_parallel_axes, scatter_dimension=axis, tiled=True)
        return jax.lax.psum(x, axes)


def vocab_cross_entropy_sums(env: ShardEnv | None, logits, labels, mask):
    """(sum of per-token losses, number of counted tokens) with logits [..., V/tp] split over vocab."""
    lf = logits.astype(jnp.float32)
    v_local = lf.shape[-1]
    lo = (env.index("vocab") if env else 0) * v_local
    m = jax.lax.stop_gradient(jnp.max(lf, axis=-1, keepdims=True))
    if env is not None and env.axes("vocab"):
        m = jax.lax.pmax(m, env.axes("vocab"))
    sumexp = env.psum(jnp.sum(jnp.exp(lf - m), axis=-1), "vocab") if env else jnp.sum(jnp.exp(lf - m), axis=-1)
    local = labels.astype(jnp.int32) - lo
    inside = (local >= 0) & (local < v_local)
    picked = jnp.take_along_axis(lf, jnp.clip(local, 0, v_local - 1)[..., None], axis=-1)[..., 0]
    picked = jnp.where(inside, picked, 0.0)
    picked = env.psum(picked, "vocab") if env else picked
    per_token = jnp.log(sumexp) + m[..., 0] - picked
    w = jnp.ones_like(per_token) if mask is None else mask.astype(jnp.float32)
    return jnp.sum(per_token * w), jnp.sum(w)
