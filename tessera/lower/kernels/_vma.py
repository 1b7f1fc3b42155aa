"""Kernel outputs inside `jax.shard_map`: a Pallas call's out_shape must say over which mesh axes it varies.

With `check_vma=True` (Tessera's fast mode) every value inside `shard_map` carries the set of mesh axes it
varies over, and `pallas_call` refuses an out_shape that does not state it. A kernel's output varies
wherever any of its inputs does; where none varies the plain struct is kept. (A check_vma step whose kernel
inputs are all replicated would still need the explicit empty set: Tessera's sharded steps do not call
kernels until they are verified there: `Kernel.in_shard_map` in tessera/lower/table.py.)
"""

from __future__ import annotations

import jax


def _manual(x):
    return getattr(jax.typeof(x), "manual_axis_type", None)


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """ShapeDtypeStruct(shape, dtype) varying over the union of the inputs' varying mesh axes."""
    found = [m for m in (_manual(x) for x in inputs) if m is not None]
    varying = frozenset().union(*(m.varying for m in found))
    if not varying:  # one device, or shard_map without check_vma: the plain struct, as every kernel has it
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=type(found[0])(varying=varying))


def _vary(x, axes: frozenset):
    """x cast to vary also over `axes` (a no-op where it already does)."""
    missing = tuple(sorted(axes - _manual(x).varying))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def common(*inputs):
    """The inputs, each cast to vary over every mesh axis any of them varies over (what a kernel call needs)."""
    found = [m for m in (_manual(x) for x in inputs) if m is not None]
    if not found:
        return inputs
    varying = frozenset().union(*(m.varying for m in found))
    return tuple(_vary(x, varying) for x in inputs)


def like(x, ref):
    """x cast to vary over every mesh axis `ref` varies over (a kernel output or a custom VJP's cotangent
    takes its primal's type this way; outside shard_map, or without check_vma, x is returned as is)."""
    want = _manual(ref)
    if want is None or _manual(x) is None:
        return x
    return _vary(x, want.varying)
