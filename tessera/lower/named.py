"""Named-dim helpers for lowerings: arrays carry their axes in the order of their IR type's dims."""

from __future__ import annotations

import string

import jax.numpy as jnp


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


def einsum(spec_in: list[tuple[str, ...]], out: tuple[str, ...], *arrays, accum=jnp.float32):
    """einsum with named dims: each operand's dim names, the output's dim names; fp32 accumulation."""
    letters: dict[str, str] = {}
    pool = iter(string.ascii_letters)

    def sub(dims):
        return "".join(letters.setdefault(d, next(pool)) for d in dims)

    spec = ",".join(sub(d) for d in spec_in) + "->" + sub(out)
    return jnp.einsum(spec, *arrays, preferred_element_type=accum)


def move_last(x, have: tuple[str, ...], dim: str):
    """x with dim `dim` moved to the last axis, and the dim order after the move."""
    i = have.index(dim)
    rest = tuple(n for n in have if n != dim)
    return jnp.moveaxis(x, i, -1), rest + (dim,)
