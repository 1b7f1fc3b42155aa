"""The lowering table: one lowering per IR op and per kind of a struct family, and the kernels that may implement
the primitives inside them.

A lowering gets the small typed context, the op (its attrs already resolved for the current layer),
its value operands as arrays (axes in the order of their IR types) and its parameters by local name
(`q`, `experts/gate`), and returns its results. A stateful lowering (attention during decoding) also
gets and returns its state; `init_state` builds the empty state for a batch and a cache length.

A struct attribute's kind (`rope = yarn{...}`, `act = swiglu{...}`, registered in tessera/ir/ops_nn.py)
has one implementation here, registered with `lowers_kind(family, kind)`; the lowerings of the ops that
read the family call it through `get_kind_lowering`. Its signature is the family's: a rope kind maps
(head_dim, fields) to (inv_freq, scaling), an act kind (fields, gate, up) to the activation.

Where a lowering computes a primitive that a kernel may run (attention, the experts' grouped products) it
calls `dispatch(ctx, primitive, label, ...)`; kernels register for a (primitive, backend) below, from
tessera/lower/kernels/__init__.py, and the kernel report (`tessera ir SPEC --after lower`) is what
`dispatch` chose for each op.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax.numpy as jnp

from tessera.lower.reference.accum import narrow


@dataclasses.dataclass(frozen=True)
class Lowering:
    """How to lower one op: the function, and for stateful ops how to make their state."""

    op: str
    fn: Callable[..., Any]
    stateful: bool = False
    init_state: Callable[..., Any] | None = None


LOWERINGS: dict[str, Lowering] = {}


def lowers(op: str, *, stateful: bool = False, init_state=None):
    """Decorator: register `fn` as the lowering of `op`; a duplicate is an error."""

    def register(fn):
        if op in LOWERINGS:
            raise ValueError(f"op `{op}` already has a lowering")
        LOWERINGS[op] = Lowering(op, fn, stateful, init_state)
        return fn

    return register


def get_lowering(op: str) -> Lowering:
    """The lowering of `op`."""
    from tessera.lower import ops_core, ops_nn, ops_spectral  # noqa: F401  (registration happens on import)

    found = LOWERINGS.get(op)
    if found is None:
        raise NotImplementedError(f"no lowering for op `{op}`")
    return found


KIND_LOWERINGS: dict[tuple[str, str], Callable[..., Any]] = {}  # (struct family, kind) -> implementation


def lowers_kind(family: str, kind: str):
    """Decorator: register `fn` as the implementation of struct `kind` of `family`; a duplicate is an error."""

    def register(fn):
        if (family, kind) in KIND_LOWERINGS:
            raise ValueError(f"`{kind}` of struct family `{family}` already has a lowering")
        KIND_LOWERINGS[(family, kind)] = fn
        return fn

    return register


def get_kind_lowering(family: str, kind: str) -> Callable[..., Any]:
    """The implementation of struct `kind` of `family`."""
    from tessera.lower import ops_core, ops_nn, ops_spectral  # noqa: F401  (registration happens on import)

    found = KIND_LOWERINGS.get((family, kind))
    if found is None:
        raise NotImplementedError(f"no lowering for `{kind}` of struct family `{family}`")
    return found


# ----------------------------------------------------------------------------- kernels
# Inside an op's lowering some primitives (attention over a sequence or a KV cache, the experts' grouped
# products) may run as a Pallas kernel. Each primitive has a `jax.numpy` reference; kernels register for a
# (primitive, backend) with `kernel(...)` (tessera/lower/kernels/__init__.py) and `dispatch` runs the first
# that may run and takes the operands, recording the choice, or why none was taken, in the kernel report.

REFERENCE_NAME = "reference (jax.numpy)"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel for one primitive on one backend.

    `fn` has the reference's signature and semantics. `when(*args, **kw)` is True when the kernel takes
    these operands, a string saying why not, or False when the operands are not its kind (said nowhere).
    `in_shard_map`: verified on a GPU inside the sharded train and forward steps (`shard_map` with check_vma:
    tests/lower/kernels/test_shard_map_gpu.py); until then those steps keep the reference.
    """

    primitive: str
    name: str  # the kernel report's words for it
    fn: Callable[..., Any]
    when: Callable[..., bool | str]
    backend: str = "gpu"
    in_shard_map: bool = False

    @property
    def short(self) -> str:
        return self.name.split(" (")[0]


PRIMITIVES: dict[str, Callable[..., Any]] = {}  # primitive -> its reference
KERNELS: dict[tuple[str, str], list[Kernel]] = {}


def primitive(name: str, reference: Callable[..., Any]) -> None:
    """Declare a primitive kernels may implement, with the reference that defines it."""
    PRIMITIVES[name] = reference


def kernel(primitive: str, *, name: str, when, backend: str = "gpu", in_shard_map: bool = False):
    """Decorator: register `fn` as a kernel for `primitive` on `backend` (tried in registration order)."""

    def register(fn):
        KERNELS.setdefault((primitive, backend), []).append(Kernel(primitive, name, fn, when, backend, in_shard_map))
        return fn

    return register


def _table():
    from tessera.lower import kernels  # noqa: F401  (registration happens on import; kernel modules load lazily)
    return PRIMITIVES, KERNELS


def choose(ctx, primitive: str, *args, **kw) -> tuple[str, Callable[..., Any]]:
    """(what runs, its function) for `primitive` on these operands under ctx's kernel policy and backend."""
    prims, table = _table()
    reference = prims[primitive]
    if getattr(ctx, "fp8", None) and primitive == "ragged_dot":  # the experts' products in fp8 (reference/fp8.py)
        from tessera.lower.reference import fp8

        return (f"{REFERENCE_NAME}: fp8 products (e4m3 operands, e5m2 gradients, {ctx.fp8} scales)",
                functools.partial(fp8.ragged_dot, accum=ctx.accum_dtype, scaling=ctx.fp8))
    if narrow(ctx.accum_dtype):  # the kernels accumulate in fp32: the reference emulates the narrow accumulator
        name = jnp.dtype(ctx.accum_dtype).name
        return (f"{REFERENCE_NAME}: accumulates in {name} (@accum); the kernels accumulate in fp32",
                functools.partial(reference, accum=ctx.accum_dtype))
    if ctx.kernels != "auto":
        return f"{REFERENCE_NAME}: kernels = {ctx.kernels}", reference
    candidates = table.get((primitive, ctx.backend), [])
    if not candidates:
        return f"{REFERENCE_NAME}: no kernel for backend {ctx.backend}", reference
    checked = ctx.shard is not None and ctx.mode not in ("prefill", "decode")  # generation runs without check_vma
    why, unverified = [], []
    for k in candidates:
        if checked and not k.in_shard_map:
            unverified.append(k.short)
            continue
        ok = k.when(*args, **kw)
        if ok is True:
            return k.name, k.fn
        if isinstance(ok, str):
            why.append(ok)
    if unverified:
        why.append(" / ".join(unverified) + " not yet verified inside the sharded step (shard_map with check_vma)")
    return REFERENCE_NAME + (": " + "; ".join(why) if why else ""), reference


def dispatch(ctx, primitive: str, label: str, *args, **kw):
    """primitive(*args, **kw) by `choose`'s pick; the choice goes into ctx.report under `label`."""
    choice, fn = choose(ctx, primitive, *args, **kw)
    if ctx.report is not None:
        ctx.report[label] = choice
    return fn(*args, **kw)


def bound(ctx, primitive: str, label: str) -> Callable[..., Any]:
    """`dispatch` as a function of the operands (for references that take the primitive as an argument)."""
    return lambda *args, **kw: dispatch(ctx, primitive, label, *args, **kw)
