"""How the program holds a parameter of each IR element type, and the checks packed storage needs.

Plain types are jax arrays of their dtype, fp8_e4m3 / fp8_e5m2 included (one byte per element, values on
the fp8 grid, cast to the compute type at use; `to_held` saturates at the format's largest value rather than
making NaN of what lies beyond it). Packed types are pytrees of codes and scales, dequantised by the lowerings at
use (tessera/lower/reference/packed.py): block formats (`NumericType.is_block_format`: mxfp4) are `MXFP4`
(tessera/lower/reference/mxfp4.py) grouped along the second-to-last dim; block-scaled fp8 (`fp8_e4m3_b128`, from
`fp8_e4m3 @scale(per_block(128))`) is `FP8Blocks`, one byte a weight plus an fp32 scale per N×N block of the last
two dims (tessera/lower/reference/fp8_blocks.py). fp6 and fp4_e2m1 have no held form (check refuses them).
"""

from __future__ import annotations

import dataclasses
import fnmatch

import jax
import jax.numpy as jnp
import numpy as np

from tessera.diagnostics import Diagnostic, TesseraError
from tessera.grammar.numerics import BASE_TYPES, MX_BLOCK, NumericType, block_scaled, block_scaled_bits
from tessera.lower.context import jnp_dtype
from tessera.lower.options import CompileOptions
from tessera.lower.reference import fp8_blocks, mxfp4

HELD_AS_BF16 = 16.0  # bits per element of a low-precision float the program holds as bf16


def is_packed(ir_dtype: str) -> bool:
    """Whether parameters of this IR element type are held packed (MXFP4 or FP8Blocks pytrees)."""
    return is_mx(ir_dtype) or block_scaled(ir_dtype) is not None


def is_mx(ir_dtype: str) -> bool:
    """Whether parameters of this IR element type are MXFP4 pytrees (groups of 32 along K)."""
    return ir_dtype in BASE_TYPES and NumericType(ir_dtype).is_block_format


def storage_dtype(ir_dtype: str):
    """The jax dtype of a plain (unpacked) parameter: its own, or bf16 for low-precision floats held widened."""
    try:
        return jnp_dtype(ir_dtype)
    except NotImplementedError:
        if ir_dtype in BASE_TYPES or ir_dtype == "fp8":
            return jnp.bfloat16
        raise


def to_held(x, dtype):
    """x as a plain parameter of `dtype`: a cast, saturating for fp8 (whose cast makes NaN beyond its range)."""
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(jnp.asarray(x, jnp.float32), -big, big)
    return jnp.asarray(x, dtype)


def abstract(shape: tuple[int, ...], ir_dtype: str):
    """What the program holds for a parameter, as ShapeDtypeStructs: one, MXFP4(codes, scales) or
    FP8Blocks(codes, scales)."""
    if block_scaled(ir_dtype):
        return fp8_blocks.abstract(shape, block_scaled(ir_dtype)[1])
    if is_packed(ir_dtype):
        return mxfp4.abstract(shape)
    return jax.ShapeDtypeStruct(shape, storage_dtype(ir_dtype))


def storage_bits(ir_dtype: str) -> float:
    """Bits per element of what the program holds (mxfp4 = 4.25; fp8_e4m3_b128 = 8 + 32/128²; fp6/fp4 held as
    bf16 = 16)."""
    if block_scaled(ir_dtype):
        return block_scaled_bits(ir_dtype)
    if is_packed(ir_dtype):
        return NumericType(ir_dtype).bits_per_element
    return jnp.dtype(storage_dtype(ir_dtype)).itemsize * 8.0


def _rule_key(options: CompileOptions, path: str) -> tuple[str, object]:
    """(key, span) of the numerics rule that gives `path` its type: the last matching glob."""
    glob = next((g for g in reversed(list(options.numerics.rules or {})) if fnmatch.fnmatchcase(path, g)), None)
    if glob is None:
        return "numerics.params", options.span("numerics.params")
    return "numerics.rules", options.span(f"numerics.rules.{glob}") or options.span("numerics.rules")


def check_packed(options: CompileOptions, graph) -> None:
    """Packed parameters fit their task, shape and mesh; a TesseraError naming each one that does not."""
    from tessera.lower.shard.rules import annotated_axes

    rules = options.rules if options.mesh_size > 1 else None
    held = held_types(options, graph) if rules is not None else {}
    problems: list[Diagnostic] = []
    for path, p in graph.params.items():
        if not is_packed(p.type.dtype):
            continue
        key, span = _rule_key(options, path)
        dims = p.type.dims
        if options.trains:
            problems.append(Diagnostic(
                f"{p.type.dtype} storage is for inference tasks: generate/forward/bench without train_step; "
                f"parameter `{path}` is trained by task.kind={options.task_kind}", span=span, key=key,
                hint="for training keep the experts in bf16/fp32 (drop this rule, or give them bf16)"))
        elif block_scaled(p.type.dtype):
            problems += _check_blocks(options, rules, path, p.type, span, key)
        elif len(dims) < 2 or dims[-2].size % MX_BLOCK:
            got = f"`{dims[-2].name}` = {dims[-2].size}" if len(dims) >= 2 else f"{len(dims)} dim"
            problems.append(Diagnostic(
                f"{p.type.dtype} packs groups of {MX_BLOCK} along a parameter's second-to-last dim; "
                f"`{path}` has {got}", span=span, key=key,
                hint="give this parameter a plain type, e.g. add a later rule `\"*_bias\": bf16`"))
        elif rules is not None:
            k_axes = annotated_axes(p.type)[-2]  # how the program places it
            problems += _check_split(options, rules, path, held[path], k_axes)  # K as held: a padded d_ff fits
    if problems:
        raise TesseraError(problems)


def _check_blocks(options, rules, path: str, t, span, key: str) -> list[Diagnostic]:
    """A block-scaled fp8 parameter's last two dims are whole numbers of N-blocks, on the whole and on every
    device of the mesh (a block never straddles two devices)."""
    n, dims = block_scaled(t.dtype)[1], t.dims
    written = f"fp8_e4m3 @scale(per_block({n}))"
    if len(dims) < 2:
        return [Diagnostic(f"{written} scales {n}×{n} blocks of a parameter's last two dims; `{path}` has "
                           f"{len(dims)} dim", span=span, key=key,
                           hint="give this parameter a plain type, e.g. add a later rule `\"*/scale\": bf16`")]
    bad = [d for d in dims[-2:] if d.size % n]
    if bad:
        d = bad[0]
        ok = [str(b) for b in (128, 64, 32, 16) if all(e.size % b == 0 for e in dims[-2:])]
        return [Diagnostic(f"{written} needs block size {n} to divide the last two dims of `{path}`; `{d.name}` = "
                           f"{d.size} is not a multiple of {n}", span=span, key=key,
                           hint=f"use a block size dividing {' and '.join(str(e.size) for e in dims[-2:])}"
                                + (f", e.g. per_block({ok[0]})" if ok else "") + ", or a plain type for it")]
    if rules is None:
        return []
    from tessera.lower.shard.rules import annotated_axes

    out = []
    for d, axes in zip(dims[-2:], annotated_axes(t)[-2:]):
        ways = rules.size(axes) if axes else 1
        if ways > 1 and (d.size // n) % ways:
            axis = axes[-1]
            out.append(Diagnostic(
                f"mesh axes {'×'.join(axes)} split `{d.name}` = {d.size} of `{path}` ({written}) into {ways} pieces "
                f"of {d.size // ways}, not whole {n}-element scale blocks", span=options.span(f"mesh.{axis}"),
                key=f"mesh.{axis}", hint=f"use a mesh whose {'×'.join(axes)} divides {d.size // n}, or a smaller block"))
    return out


def _check_split(options, rules, path: str, t, axes: tuple[str, ...]) -> list[Diagnostic]:
    """The mesh axes splitting K (`axes`, of held type `t`) split its K/32 scale groups too (none straddles
    devices)."""
    k = t.dims[-2]
    n = rules.size(axes) if axes else 1
    if n <= 1 or (k.size // MX_BLOCK) % n == 0:
        return []
    axis = axes[-1]
    shown = "×".join(f"{a}={dict(rules.sizes)[a]}" for a in axes)
    ok = [str(d) for d in range(2, k.size // MX_BLOCK + 1) if (k.size // MX_BLOCK) % d == 0][:4]
    return [Diagnostic(
        f"{shown} splits `{k.name}` = {k.size} of {t.dtype} parameter `{path}` into blocks of "
        f"{k.size // n}, which is not a whole number of {MX_BLOCK}-element scale groups "
        f"({k.size // MX_BLOCK} groups over {n} devices)", span=options.span(f"mesh.{axis}"), key=f"mesh.{axis}",
        hint=f"use a mesh whose {'×'.join(axes)} divides {k.size // MX_BLOCK}: {', '.join(ok) or '1'}; "
             f"or split the experts instead (ep)")]


# ---- padding a MoE's d_ff so packed groups never straddle devices ------------------------------------------
#
# tp=8 splits GPT-OSS's down [experts, mlp=2880, embed] along K = mlp into blocks of 360 = 11.25 scale groups.
# Serving stacks pad d_ff in storage instead: the program holds every param of the moe op that has the `mlp`
# dim at the next multiple of 32 · ways(mlp) (2880 → 3072 at tp=8, 2944 at tp=4, unchanged at tp=2 or ep=8).
# The padding is exact: gate/up get zero columns and zero biases, so h = act(0, 0) = 0 there, and down zero
# rows. The IR keeps the true size (FLOPs, the model contract, HF checkpoints); only what is held grows.

PAD_SCALE = 127  # the E8M0 scale of padded groups: 2^0 (their codes are 0, +0.0, so any scale would do)


def _moe_d_ff(graph) -> dict[str, str]:
    """{param path: the name of its moe op's d_ff dim} for every param a moe op owns (d_ff: gate's last dim)."""
    from tessera.ir.types import ParamRef

    out: dict[str, str] = {}
    for op in graph.walk():
        paths = [o.path for o in op.operands if isinstance(o, ParamRef)]
        gate = next((p for p in paths if p.endswith("experts/gate")), None)
        if op.name == "moe" and gate is not None and gate in graph.params:
            out.update({p: graph.params[gate].type.dims[-1].name for p in paths})
    return out


def padding(options: CompileOptions, graph) -> dict[str, dict[str, int]]:
    """{param path: {dim name: held size}} for the params held larger than the IR says (empty on one device).

    A moe op's d_ff dim is padded when one of its packed params contracts over it (K) and the mesh axes
    splitting it would cut a 32-element scale group: then every param of that op with the dim is padded."""
    if options.mesh_size <= 1:
        return {}
    from tessera.lower.shard.rules import annotated_axes

    rules, owned = options.rules, _moe_d_ff(graph)
    held: dict[str, int] = {}  # d_ff dim name -> held size (moe ops naming the same dim share it)
    for path, name in owned.items():
        dims = graph.params[path].type.dims
        if not is_mx(graph.params[path].type.dtype) or len(dims) < 2 or dims[-2].name != name:
            continue
        k, n = dims[-2].size, rules.size(annotated_axes(graph.params[path].type)[-2])  # ways K is split
        step = MX_BLOCK * n
        if k % MX_BLOCK == 0 and (k // MX_BLOCK) % n:
            held[name] = max(held.get(name, 0), -(-k // step) * step)
    return {path: {name: held[name]} for path, name in owned.items()
            if name in held and name in graph.params[path].type.names}


def held_types(options: CompileOptions, graph) -> dict:
    """Each parameter's TensorType as the program holds it: the IR's, with padded dims at their held size."""
    pads = padding(options, graph)
    out = {}
    for path, p in graph.params.items():
        grow = pads.get(path, {})
        dims = tuple(dataclasses.replace(d, size=grow.get(d.name, d.size)) for d in p.type.dims)
        out[path] = dataclasses.replace(p.type, dims=dims)
    return out


def held_params(options: CompileOptions, graph) -> dict:
    """graph.params with each Param's type as held (what a mesh splits: the divisibility checks read this)."""
    types = held_types(options, graph)
    return {path: dataclasses.replace(p, type=types[path]) for path, p in graph.params.items()}


def resize(value, shape: tuple[int, ...]):
    """`value` (an array or MXFP4 of logical shape [..., K, N]) padded or sliced to logical `shape`.

    Padding is zeros (codes 0 = +0.0, scales PAD_SCALE); slicing keeps the leading block of each dim."""
    if tuple(value.shape) == tuple(shape):
        return value
    if isinstance(value, fp8_blocks.FP8Blocks):
        raise ValueError(f"block-scaled fp8 parameters are held at their own shape; cannot resize {value.shape} "
                         f"to {shape}")
    if isinstance(value, mxfp4.MXFP4):
        *lead, k, n = shape
        return mxfp4.MXFP4(_fit(value.codes, (*lead, k // 2, n), 0),
                           _fit(value.scales, (*lead, k // MX_BLOCK, n), PAD_SCALE))
    return _fit(value, shape, 0)


def _fit(x, shape: tuple[int, ...], fill):
    # pad (with `fill`) or slice each dim of x to `shape`; numpy stays numpy (host loads), jax stays jax
    xp = jnp if isinstance(x, jax.Array) else np
    x = x[tuple(slice(0, s) for s in shape)]
    pad = [(0, s - d) for s, d in zip(shape, x.shape)]
    return xp.pad(x, pad, constant_values=xp.asarray(fill, x.dtype)) if any(p for _, p in pad) else x
