"""A program's fresh parameters: each drawn from its initializer at the IR's shape, then held as the program
holds it (padded, packed, block-scaled). A parameter's values depend only on (seed, path), and a stacked
parameter's layer i only on (seed, path, i), so the stacked and the split forms are bitwise the same.
`Program.init` calls `init_each` (or `init_split`); `init_params` is the same draw as one traced function.
"""

from __future__ import annotations

import functools
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

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
    p, held = prog.graph.params[path], _held_key(prog.param_shapes()[path])
    key = jax.random.fold_in(key, zlib.crc32(path.encode()))
    true = tuple(d.size for d in p.type.dims)  # drawn at the IR's shape, then padded
    if layer is not None:
        key, true, held = jax.random.fold_in(key, layer), true[1:], _one_layer(held)
    return _held_value(p.init, key, true, held)


def _path_hash(path: str):
    """The path's key data, a host scalar (uint32): no device array is left behind per parameter."""
    return np.uint32(zlib.crc32(path.encode()))


def _held_key(held) -> tuple:
    """How a parameter is held, hashable: ("fp8", shape, block), ("mxfp4", shape) or ("array", shape, dtype)."""
    if isinstance(held, fp8_blocks.FP8Blocks):
        return ("fp8", tuple(held.shape), held.block)
    if isinstance(held, mxfp4.MXFP4):
        return ("mxfp4", tuple(held.shape))
    return ("array", tuple(held.shape), jnp.dtype(held.dtype).name)


def _one_layer(held: tuple) -> tuple:
    return (held[0], held[1][1:]) + held[2:]


def _held_value(init, key, true: tuple, held: tuple):
    """A value drawn at IR shape `true`, held as `held` (`_held_key`): fp8 blocks are the plain fp32 draw
    quantised (at their own shape), MXFP4 and plain arrays are padded to the held shape."""
    if held[0] == "fp8":
        return fp8_blocks.quantize(_init_array(init, key, true, jnp.float32), held[2])
    if held[0] == "mxfp4":
        return storage.resize(_init_packed(init, key, true), held[1])
    return storage.resize(_init_array(init, key, true, held[2]), held[1])


def init_each(prog, seed, shardings: dict | None = None) -> dict:
    """`init_params`' values, each parameter by a small jitted program of its own (`_drawer`), placed by
    `shardings`. A program depends only on the parameter's initializer, shapes and placement, not on its path
    (the path's hash is an argument), so the parameters of one shape share one compile, within a model, across
    models and, through JAX's persistent cache, across processes: one jitted draw of a whole small model compiles
    in ~0.6 s of XLA:CPU, most of it one random draw after another."""
    stacked, shapes, seed = prog.stacked(), prog.param_shapes(), jnp.asarray(seed, jnp.uint32)
    shardings = shardings or {}
    return {path: _param_drawer(prog, shapes, path, stacked.get(path), shardings.get(path))(seed, _path_hash(path))
            for path in shapes}


def _param_drawer(prog, shapes: dict, path: str, layers: int | None, sharding):
    """`_drawer` for parameter `path` of `prog` (`shapes`: its param_shapes())."""
    p = prog.graph.params[path]
    return _drawer(p.init, tuple(d.size for d in p.type.dims), _held_key(shapes[path]), layers, sharding)


@functools.lru_cache(maxsize=None)
def _drawer(init, true: tuple, held: tuple, layers: int | None, sharding):
    """(seed, path hash) -> one parameter's initial value, jitted: `init_param`'s draw for a parameter of IR
    shape `true` held as `held` (`_held_key`), stacked over `layers`, or not (None); layers=0: (seed, path
    hash, i) -> layer i of a stacked one."""
    def one(key, i):
        return _held_value(init, jax.random.fold_in(key, i), true[1:], _one_layer(held))

    def draw(seed, path_hash, *layer):
        key = jax.random.fold_in(jax.random.key(seed), path_hash)
        if layers is None:
            return _held_value(init, key, true, held)
        if layers == 0:
            return one(key, *layer)
        return jax.lax.map(lambda i: one(key, i), jnp.arange(layers, dtype=jnp.uint32))
    return jax.jit(draw, out_shardings=sharding)


def init_split(prog, seed, on_layer: Callable[[int], None] | None) -> dict:
    """The parameters with each stacked one as the list of its layers, made one layer at a time (one small
    program called per parameter and layer, shared as `init_each`'s are), placed on the program's mesh;
    `on_layer(i)` after layer i is made."""
    stacked, shapes, seed = prog.stacked(), prog.param_shapes(), jnp.asarray(seed, jnp.uint32)
    specs = prog.shardings(prog.param_shapes(split_layers=True)) or {}  # a stacked one's: a list, layers alike
    hashes = {path: _path_hash(path) for path in shapes}
    params = {path: _param_drawer(prog, shapes, path, None, specs.get(path))(seed, hashes[path])
              for path in shapes if path not in stacked}
    for n in sorted(set(stacked.values())):
        paths = [p for p, m in stacked.items() if m == n]
        draws = {p: _param_drawer(prog, shapes, p, 0, specs[p][0] if specs else None) for p in paths}
        for p in paths:
            params[p] = []
        for i in range(n):
            layer = np.uint32(i)  # a host scalar: no device array outlives the call
            for p in paths:
                params[p].append(draws[p](seed, hashes[p], layer))
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
