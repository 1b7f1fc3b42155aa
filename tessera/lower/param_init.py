"""A program's fresh parameters: each drawn from its initializer at the IR's shape, then held as the program
holds it (padded, packed, block-scaled). A parameter's values depend only on (seed, path), and a stacked
parameter's layer i only on (seed, path, i), so the stacked and the split forms are bitwise the same.
`Program.init` jits `init_params` (or calls `init_split`).
"""

from __future__ import annotations

import zlib
from typing import Callable

import jax
import jax.numpy as jnp

from tessera.lower import storage
from tessera.lower.reference import fp8_blocks, mxfp4


def init_params(prog, seed) -> dict:
    """Every parameter of `prog` from a uint32 seed, stacked ones drawn one layer at a time; traced, not jitted."""
    key, stacked = jax.random.key(seed), prog.stacked()
    params = {}
    for path in prog.param_shapes():
        if path in stacked:  # one layer at a time: a whole stacked draw in fp32 would sit in memory
            layers = jnp.arange(stacked[path], dtype=jnp.uint32)
            params[path] = jax.lax.map(lambda i, path=path: init_param(prog, key, path, i), layers)
        else:
            params[path] = init_param(prog, key, path)
    return params


def init_param(prog, key, path: str, layer=None):
    """One parameter's initial value at its held shape, or (layer) layer `layer` of a stacked one."""
    p, held = prog.graph.params[path], prog.param_shapes()[path]
    key = jax.random.fold_in(key, zlib.crc32(path.encode()))
    true, shape = tuple(d.size for d in p.type.dims), tuple(held.shape)  # drawn at the IR's shape, then padded
    if layer is not None:
        key, true, shape = jax.random.fold_in(key, layer), true[1:], shape[1:]
    if isinstance(held, fp8_blocks.FP8Blocks):  # the plain fp32 draw, quantised (held at its own shape)
        return fp8_blocks.quantize(_init_array(p.init, key, true, jnp.float32), held.block)
    if isinstance(held, mxfp4.MXFP4):
        return storage.resize(_init_packed(p.init, key, true), shape)
    return storage.resize(_init_array(p.init, key, true, held.dtype), shape)


def init_split(prog, seed, on_layer: Callable[[int], None] | None) -> dict:
    """The parameters with each stacked one as the list of its layers, made one layer at a time (one small
    program called per layer), placed on the program's mesh; `on_layer(i)` after layer i is made."""
    stacked, shapes = prog.stacked(), prog.param_shapes()
    specs = prog.shardings(prog.param_shapes(split_layers=True))
    pick = lambda paths: None if specs is None else {p: specs[p] for p in paths}  # noqa: E731
    shared = [p for p in shapes if p not in stacked]
    make = jax.jit(lambda s: {p: init_param(prog, jax.random.key(s), p) for p in shared},
                   out_shardings=pick(shared))
    params = dict(make(seed))
    for n in sorted(set(stacked.values())):
        paths = [p for p, m in stacked.items() if m == n]
        layer_specs = None if specs is None else {p: specs[p][0] for p in paths}
        one = jax.jit(lambda s, i, paths=paths: {p: init_param(prog, jax.random.key(s), p, i) for p in paths},
                      out_shardings=layer_specs)
        for p in paths:
            params[p] = []
        for i in range(n):
            made = one(seed, jnp.asarray(i, jnp.uint32))
            for p in paths:
                params[p].append(made[p])
            del made
            if on_layer is not None:
                on_layer(i)
    return {p: params[p] for p in shapes}


def _init_array(init, key, shape, dtype):
    """One parameter's initial value: normal(0, std) drawn in fp32, ones or zeros."""
    if init.kind == "normal":
        return storage.to_held(jax.random.normal(key, shape, jnp.float32) * init.std, dtype)
    return (jnp.ones if init.kind == "ones" else jnp.zeros)(shape, dtype)


def _init_packed(init, key, shape):
    """A packed (MXFP4) parameter's initial value, drawn in fp32 and quantised one [K, N] matrix at a time
    (each leading index i folded into the key): quantising reduces over groups, so a whole draw would sit
    in memory in fp32 (one 120b layer's 128 experts: 8.5 GB)."""
    if len(shape) < 3:
        return mxfp4.quantize(_init_array(init, key, shape, jnp.float32))
    one = lambda i: _init_packed(init, jax.random.fold_in(key, i), shape[1:])  # noqa: E731
    return jax.lax.map(one, jnp.arange(shape[0], dtype=jnp.uint32))
