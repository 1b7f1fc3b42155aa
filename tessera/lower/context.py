"""The lowering context: the few facts a lowering may depend on, typed and immutable."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "f64": jnp.float64,
           "i32": jnp.int32, "i64": jnp.int64, "i8": jnp.int8, "u8": jnp.uint8, "bool": jnp.bool_,
           "c64": jnp.complex64, "c128": jnp.complex128,
           "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}  # fp8: parameter storage (inference)


def jnp_dtype(name: str):
    """The jax dtype of an IR element type (`bf16` → jnp.bfloat16)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise NotImplementedError(f"element type `{name}` has no jax array type yet") from None


# Values a lowering names with `jax.ad_checkpoint.checkpoint_name` for remat `dots` to keep besides the
# contraction outputs: a kernel's residuals that would otherwise cost a second forward in the backward pass.
REMAT_SAVED = ("attention_out", "attention_lse")


@dataclasses.dataclass(frozen=True)
class LowerCtx:
    """What a lowering may read besides its op: numerics, mode, positions, kernel policy.

    mode: "train" (full sequence, no cache), "prefill" (full prompt, fills the cache) or
    "decode" (new tokens against the cache). positions: int32 [batch, seq] absolute positions of the
    tokens being processed; position_start: where the caller knows them to be one run for every row
    (positions[b, s] = position_start + s: generation's prefill and decode steps), that int32 scalar, which
    lets a cache take the new tokens as one slice. shard: inside `shard_map`, which mesh axes split which
    logical axes and the collectives that go with them (lowerings then see local blocks). unroll: `repeat` runs its layers
    unrolled over per-layer parameters and states (generation; tessera/lower/interpret.py says why).
    last_only: the caller reads only the last position's output (generation's prefill samples from it), so
    `unembed` projects that position alone: a prompt's [batch, seq, vocab] logits are never made.
    """

    accum_dtype: Any = jnp.float32
    mode: str = "train"
    positions: Any = None
    position_start: Any = None
    kernels: str = "reference"  # "auto" lets lowerings pick a kernel where the backend and shapes allow
    backend: str = "cpu"
    deterministic: bool = True
    shard: Any = None  # tessera.lower.shard.collectives.ShardEnv inside shard_map, None on one device
    report: Any = None  # a dict that kernel selection records its choices in ({op label: implementation})
    aux: Any = None  # a dict of step counters lowerings add int32 scalars to ({name: count}), e.g. moe_dropped
    unroll: bool = False
    fp8: str | None = None  # "per_tensor", "per_block(N)" or "delayed(H)": products with weights run in fp8 with that
    # scaling (tessera/lower/reference/fp8.py)
    fp8_history: Any = None  # under delayed scaling in a train step: {the op's param name: its amax history [3, H]}
    # (tessera/lower/fp8_delayed.py); None elsewhere (the products then take the current amax, as per_tensor)
    fp8_ops: Any = None  # {op label: its products in fp8} from numerics.compute's rules (ir/passes/numerics.py
    # `fp8_ops_of`, `fp8_op`); None: the policy's ops
    fp8_held: Any = None  # {the op's param name: (w_q, s, amax)}: its weight quantised before the repeat's scan
    # (tessera/lower/fp8_held.py); None elsewhere (each product quantises its weight)
    last_only: bool = False
    scan_unroll: bool = False  # `repeat` is still one lax.scan, which XLA unrolls (scientific models: see program.py)
    unroll_layers: bool = False  # a fast-mode train step's stacked repeats run unrolled (interpret._unrolls_stacked)
    # {path: TensorType} of the graph's params: an op that declares no params but reads one written `param(...)`
    # in the model (a primitive `dot` or `add` on it) gets it as an operand of that type (interpret.py)
    param_types: Any = None
    # {path: fn} applied to a parameter where an op reads it (inside a repeat: its layer's slice): deterministic
    # mode's gather of a device's block whole at its use (tessera/lower/shard/deterministic.py); None elsewhere
    param_use: Any = None
    # a jax.checkpoint policy for a repeat's layers in a train step whose spec asks for no remat, set by whoever
    # sets param_use (deterministic mode: every value saved but its gathered parameters,
    # layerwise.saveable_but_gathers); None: no remat
    layer_remat: Any = None
    # deterministic tp (parallel.canonical_tp > 1): (k, axes), this device's k canonical chunks of each tp-split
    # contraction and the mesh axes the chunks are split over (() on one device, where k is all of them);
    # attention and the MLP compute through tessera/lower/shard/det_tensor.py's operators. None: no chunks
    tensor: Any = None
    # deterministic ep (parallel.canonical_ep > 1): (first, k, Q, axes), this device's k of the Q canonical chunks of
    # every moe op's experts from the first-th, over the mesh axes the chunks are split over (tessera/lower/shard/
    # det_expert.py); None: no chunks
    experts: Any = None

    def replace(self, **changes) -> "LowerCtx":
        return dataclasses.replace(self, **changes)
