"""How the program holds a parameter of each IR element type, and the checks packed storage needs.

Plain types are jax arrays of their dtype. Block formats (`NumericType.is_block_format`: mxfp4) are
packed `MXFP4` pytrees (codes + scales, tessera/lower/reference/mxfp4.py) grouped along the
second-to-last dim, dequantised by the lowerings at use. Other low-precision floats (fp8, fp6, fp4_e2m1)
have no packed form yet and are held as bf16 arrays.
"""

from __future__ import annotations

import fnmatch

import jax
import jax.numpy as jnp

from tessera.diagnostics import Diagnostic, TesseraError
from tessera.grammar.numerics import BASE_TYPES, MX_BLOCK, NumericType
from tessera.lower.context import jnp_dtype
from tessera.lower.reference import mxfp4

HELD_AS_BF16 = 16.0  # bits per element of a low-precision float the program holds as bf16


def is_packed(ir_dtype: str) -> bool:
    """Whether parameters of this IR element type are held packed (MXFP4 pytrees)."""
    return ir_dtype in BASE_TYPES and NumericType(ir_dtype).is_block_format


def storage_dtype(ir_dtype: str):
    """The jax dtype of a plain (unpacked) parameter: its own, or bf16 for low-precision floats held widened."""
    try:
        return jnp_dtype(ir_dtype)
    except NotImplementedError:
        if ir_dtype in BASE_TYPES or ir_dtype == "fp8":
            return jnp.bfloat16
        raise


def abstract(shape: tuple[int, ...], ir_dtype: str):
    """What the program holds for a parameter, as ShapeDtypeStructs: one, or MXFP4(codes, scales)."""
    if is_packed(ir_dtype):
        return mxfp4.abstract(shape)
    return jax.ShapeDtypeStruct(shape, storage_dtype(ir_dtype))


def storage_bits(ir_dtype: str) -> float:
    """Bits per element of what the program holds (mxfp4 = 4.25; fp8/fp6/fp4 held as bf16 = 16)."""
    if is_packed(ir_dtype):
        return NumericType(ir_dtype).bits_per_element
    return jnp.dtype(storage_dtype(ir_dtype)).itemsize * 8.0


def _rule_key(exp, path: str) -> tuple[str, object]:
    """(key, span) of the numerics rule that gives `path` its type: the last matching glob."""
    glob = next((g for g in reversed(list(exp.numerics.rules or {})) if fnmatch.fnmatchcase(path, g)), None)
    if glob is None:
        return "numerics.params", exp.span("numerics.params")
    return "numerics.rules", exp.span(f"numerics.rules.{glob}") or exp.span("numerics.rules")


def _trains(exp) -> bool:
    task = exp.task
    return task.kind == "train" or (task.kind == "bench" and "train_step" in getattr(task, "what", ()))


def check_packed(exp, graph) -> None:
    """Packed parameters fit their task, shape and mesh; a TesseraError naming each one that does not."""
    from tessera.lower.shard.rules import AxisRules

    rules = AxisRules.from_experiment(exp) if exp.mesh.size > 1 else None
    problems: list[Diagnostic] = []
    for path, p in graph.params.items():
        if not is_packed(p.type.dtype):
            continue
        key, span = _rule_key(exp, path)
        dims = p.type.dims
        if _trains(exp):
            problems.append(Diagnostic(
                f"{p.type.dtype} storage is for inference tasks: generate/forward/bench without train_step; "
                f"parameter `{path}` is trained by task.kind={exp.task.kind}", span=span, key=key,
                hint="for training keep the experts in bf16/fp32 (drop this rule, or give them bf16)"))
        elif len(dims) < 2 or dims[-2].size % MX_BLOCK:
            got = f"`{dims[-2].name}` = {dims[-2].size}" if len(dims) >= 2 else f"{len(dims)} dim"
            problems.append(Diagnostic(
                f"{p.type.dtype} packs groups of {MX_BLOCK} along a parameter's second-to-last dim; "
                f"`{path}` has {got}", span=span, key=key,
                hint="give this parameter a plain type, e.g. add a later rule `\"*_bias\": bf16`"))
        elif rules is not None:
            problems += _check_split(exp, rules, path, p)
    if problems:
        raise TesseraError(problems)


def _check_split(exp, rules, path: str, p) -> list[Diagnostic]:
    """The mesh axes splitting K must split its K/32 scale groups too (a group never straddles devices)."""
    k = p.type.dims[-2]
    axes = rules.dims(p.type.names)[-2]
    n = rules.size(axes) if axes else 1
    if n <= 1 or (k.size // MX_BLOCK) % n == 0:
        return []
    axis = axes[-1]
    shown = "×".join(f"{a}={dict(rules.sizes)[a]}" for a in axes)
    ok = [str(d) for d in range(2, k.size // MX_BLOCK + 1) if (k.size // MX_BLOCK) % d == 0][:4]
    return [Diagnostic(
        f"{shown} splits `{k.name}` = {k.size} of {p.type.dtype} parameter `{path}` into blocks of "
        f"{k.size // n}, which is not a whole number of {MX_BLOCK}-element scale groups "
        f"({k.size // MX_BLOCK} groups over {n} devices)", span=exp.span(f"mesh.{axis}"), key=f"mesh.{axis}",
        hint=f"use a mesh whose {'×'.join(axes)} divides {k.size // MX_BLOCK}: {', '.join(ok) or '1'}; "
             f"or split the experts instead (ep)")]
