"""Named-dim helpers for lowerings: arrays carry their axes in the order of their IR type's dims."""

from __future__ import annotations

import string

import jax.numpy as jnp

from tessera.lower.reference import accum as accum_ref, fp8 as fp8_ref


def names(value) -> tuple[str, ...]:
    """The dim names of an IR value (or type), in axis order."""
    t = getattr(value, "type", value)
    return t.names


def align(x, have: tuple[str, ...], want: tuple[str, ...]):
    """Transpose x from dims `have` to dims `want`, inserting size-1 axes for dims x lacks."""
    order = [have.index(n) for n in want if n in have]
    x = jnp.transpose(x, order) if order != list(range(len(order))) else x
    present = [n for n in want if n in have]
    for i, n in enumerate(want):
        if n not in have:
            x = jnp.expand_dims(x, i)
    assert len(present) == len(have), f"dims {have} not all in {want}"
    return x


def einsum(spec_in: list[tuple[str, ...]], out: tuple[str, ...], *arrays, accum=jnp.float32, store=None,
           fp8: str | None = None, fp8_history=None, fp8_held=None, fp8_cast=None):
    """einsum with named dims: each operand's dim names, the output's dim names.

    Products accumulate in `accum` (fp32, or bf16/fp16 as reference/accum.py does it); the result is stored
    as `store` (default `accum`): see `stored_dtype`. `fp8` (a scaling, LowerCtx.fp8): the second operand is a
    weight and the product runs in fp8 with that scaling (reference/fp8.py); `fp8_history`: its amax history
    under delayed scaling in a train step; `fp8_held`: the weight already quantised (LowerCtx.fp8_held); `fp8_cast`:
    the kernel its backward quantises the output gradient with (reference/fp8.py `einsum`'s `cast`).
    """
    letters: dict[str, str] = {}
    pool = iter(string.ascii_letters)

    def sub(dims):
        return "".join(letters.setdefault(d, next(pool)) for d in dims)

    spec = ",".join(sub(d) for d in spec_in) + "->" + sub(out)
    if any(jnp.iscomplexobj(a) for a in arrays):  # complex products (spectral mode mixing): a complex result
        return jnp.einsum(spec, *arrays, preferred_element_type=jnp.result_type(*arrays))
    if store is not None and any(jnp.result_type(a) != jnp.dtype(store) for a in arrays):
        store = None  # operands wider (or other) than the stored type: keep the accumulator's
    if fp8:
        return fp8_ref.einsum(spec, *arrays, accum=accum, preferred_element_type=store or accum, scaling=fp8,
                              history=fp8_history, held=fp8_held, cast=fp8_cast)
    return accum_ref.einsum(spec, *arrays, accum=accum, preferred_element_type=store or accum)


def stored_dtype(result, accum, *, partial: bool = False):
    """The element type a matmul writes: the op's `result` type, or `accum` for partial sums.

    Under `bf16 @accum(fp32)` the GEMM accumulates in fp32 and rounds once to bf16, as casting
    an fp32 result would; a bias is then added in fp32 to the rounded product (a second
    rounding, at most half a bf16 ulp). Writing fp32 and casting afterwards is slow at decode:
    with deterministic GPU ops XLA turns an fp32-result GEMV of bf16 operands into an fp32
    conversion of the whole weight plus an fp32 cuBLAS GEMV, on every token (GPT-OSS 20b on an
    H200: 8.45 -> 6.26 ms a decode step, docs/kernels-log.md). The router keeps fp32: its logits
    choose the experts. `partial`: a tensor-parallel partial sum, summed across devices before
    it is rounded, so it stays in `accum`.
    """
    return accum if partial else result


def move_last(x, have: tuple[str, ...], dim: str):
    """x with dim `dim` moved to the last axis, and the dim order after the move."""
    i = have.index(dim)
    rest = tuple(n for n in have if n != dim)
    return jnp.moveaxis(x, i, -1), rest + (dim,)
