"""Lowering variants the experiments patch in (decode_variants, train_variants, fp8_train_forms), and `patched`, the
context that swaps them in and back: one function of the lowering replaced while a program traces."""

from __future__ import annotations

import contextlib

import jax.numpy as jnp

from tessera.lower.reference import fp8


@contextlib.contextmanager
def patched(patches):
    """Within: each (module, name, fn) of `patches` in place of module.name; afterwards the originals again."""
    old = [(m, name, getattr(m, name)) for m, name, _ in patches]
    try:
        for m, name, fn in patches:
            setattr(m, name, fn)
        yield
    finally:
        for m, name, fn in old:
            setattr(m, name, fn)


def history_only(x, row, dtype, amax=None):
    """`reference.fp8.quantize_delayed` without its fallback to the current amax while the history is empty (then
    scale 1, Transformer Engine's initial scale): the scale no longer waits on x's own reduction, so XLA may fuse the
    cast into x's producer (the amax is still measured by the caller, for the history)."""
    del amax
    s = fp8._pow2_scale(jnp.max(row), dtype)
    big = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * s, -big, big).astype(dtype), s
