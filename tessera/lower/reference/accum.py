"""Accumulation in a narrow type: the arithmetic `@accum(bf16)` and `@accum(fp16)` name.

A contraction (every product summed over a model dim: matmuls, einsums, attention's scores and its
product with v, the experts' grouped products, the `sum` op) accumulating in T does this, for each output
element: the products are taken in order along the contracted dims (flattened row-major, as the
operands lay them out) in blocks of ACCUM_BLOCK; each block is summed in fp32 and rounded to T; the
blocks are added in order into an accumulator held in T, rounded after every addition. The result is
the accumulator, in T (then cast to the stored type). ACCUM_BLOCK = 16 is the K depth of one Hopper
tensor-core instruction (`wgmma ... k16` for 16-bit operands), the unit in which a tensor core adds into
its accumulator registers.

With T = fp32 (or wider) the contraction is XLA's own (`preferred_element_type`), as before: this module
is only reached for bf16/fp16 accumulators, which it emulates exactly on any backend with XLA's
`reduce_precision` (which no excess-precision rewrite removes, unlike a round trip through a bf16
array). It is an emulation: it costs more than an fp32-accumulating GEMM and no kernel implements it,
so the lowering table runs the `jax.numpy` references under a narrow accumulator (table.choose).

Gradients follow the same arithmetic: the backward products of a contraction (the cotangent times
each operand) are contractions accumulating in T too (a custom VJP), so training under
`@accum(bf16)` accumulates in bf16 in both passes. Softmax and norm statistics, the loss's
log-sum-exp and the MoE combine of top_k weighted outputs are statistics, not contractions, and stay in
fp32 whatever `@accum` says (as in the usual mixed-precision recipes).
"""

from __future__ import annotations

import functools
import string

import jax
import jax.numpy as jnp

ACCUM_BLOCK = 16


def narrow(accum) -> bool:
    """True when `accum` is a floating type narrower than fp32 (bf16, fp16): this module's arithmetic."""
    if accum is None:
        return False
    dt = jnp.dtype(accum)
    return jnp.issubdtype(dt, jnp.floating) and dt.itemsize < 4


def round_to(x, accum):
    """x (fp32) rounded to the nearest value of `accum` (bf16/fp16), kept in x's dtype."""
    fi = jnp.finfo(accum)
    return jax.lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def _accumulate(partials, accum):
    """partials fp32 [..., n] (each already on accum's grid) added in order, rounding after every add."""
    if partials.shape[-1] == 1:
        return partials[..., 0]
    first, rest = partials[..., 0], jnp.moveaxis(partials[..., 1:], -1, 0)

    def add(acc, p):
        return round_to(acc + p, accum), None

    acc, _ = jax.lax.scan(add, first, rest)
    return acc


def _split(spec: str) -> tuple[str, str, str]:
    ins, out = spec.split("->")
    a, b = ins.split(",")
    return a, b, out


def _fresh(spec: str, n: int) -> str:
    return "".join([c for c in string.ascii_letters if c not in spec][:n])


def _blocked(spec: str, a, b, accum, out_dtype):
    a_s, b_s, o_s = _split(spec)
    con = "".join(c for c in a_s if c in b_s and c not in o_s)  # contracted, in a's order
    if any(c not in b_s and c not in o_s for c in a_s) or any(c not in a_s and c not in o_s for c in b_s):
        raise NotImplementedError(f"einsum `{spec}` sums a dim of one operand alone")
    z, k = _fresh(spec, 2)
    sizes = {**dict(zip(a_s, a.shape)), **dict(zip(b_s, b.shape))}
    n = 1
    for c in con:
        n *= sizes[c]
    nb = -(-n // ACCUM_BLOCK) if n else 1

    def blocks(x, x_s):  # x with its contracted dims last, flattened and cut into [nb, ACCUM_BLOCK]
        free = "".join(c for c in x_s if c not in con)
        x = jnp.einsum(f"{x_s}->{free}{con}", x) if x_s != free + con else x
        x = x.reshape(x.shape[:len(free)] + (n,))
        pad = nb * ACCUM_BLOCK - n  # zero products: a shorter last block, nothing added
        if pad:
            x = jnp.pad(x, [(0, 0)] * len(free) + [(0, pad)])
        return x.reshape(x.shape[:len(free)] + (nb, ACCUM_BLOCK)), free

    ab, af = blocks(a, a_s)
    bb, bf = blocks(b, b_s)
    partials = jnp.einsum(f"{af}{z}{k},{bf}{z}{k}->{o_s}{z}", ab, bb, preferred_element_type=jnp.float32)
    return _accumulate(round_to(partials, accum), accum).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _einsum(spec, a, b, accum, out_dtype):
    return _blocked(spec, a, b, accum, out_dtype)


def _einsum_fwd(spec, a, b, accum, out_dtype):
    return _blocked(spec, a, b, accum, out_dtype), (a, b)


def _einsum_bwd(spec, accum, out_dtype, res, g):
    a, b = res
    a_s, b_s, o_s = _split(spec)
    da = _einsum(f"{o_s},{b_s}->{a_s}", g, b, accum, a.dtype)
    db = _einsum(f"{a_s},{o_s}->{b_s}", a, g, accum, b.dtype)
    return da, db


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def einsum(spec: str, a, b, *, accum, preferred_element_type=None):
    """jnp.einsum of two operands accumulating in `accum`: XLA's own for fp32 and wider, else the blocked
    narrow accumulation of the module doc (result in preferred_element_type, default accum)."""
    out = preferred_element_type or accum
    if not narrow(accum):
        return jnp.einsum(spec, a, b, preferred_element_type=out)
    return _einsum(spec.replace(" ", ""), a, b, jnp.dtype(accum), jnp.dtype(out))


def sum(x, axis, *, accum, dtype=None):  # noqa: A001  (jnp.sum's name, for the reductions it replaces)
    """x summed over `axis` (an int or a tuple) accumulating in `accum` (a contraction with ones)."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(a % x.ndim for a in axes)
    out = dtype or accum
    if not narrow(accum):
        return jnp.sum(x.astype(jnp.promote_types(x.dtype, out)), axis=axes).astype(out)
    letters = string.ascii_letters[:x.ndim]
    kept = "".join(c for i, c in enumerate(letters) if i not in axes)
    summed = "".join(letters[i] for i in axes)
    ones = jnp.ones(tuple(x.shape[i] for i in axes), x.dtype)
    return _einsum(f"{letters},{summed}->{kept}", x, ones, jnp.dtype(accum), jnp.dtype(out))


def ragged_dot(lhs, rhs, group_sizes, *, accum, preferred_element_type=None):
    """jax.lax.ragged_dot (lhs [M, K] rows grouped by group_sizes, rhs [G, K, N]) accumulating in `accum`:
    K in blocks of ACCUM_BLOCK, each block's product fp32 rounded to accum, blocks added in order in accum.
    Forward only (no custom VJP: check refuses a narrow @accum for training a model with grouped experts)."""
    out = preferred_element_type or accum
    if not narrow(accum):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out)
    k = lhs.shape[-1]
    parts = []
    for start in range(0, k, ACCUM_BLOCK):
        stop = min(start + ACCUM_BLOCK, k)
        p = jax.lax.ragged_dot(lhs[:, start:stop], rhs[:, start:stop, :], group_sizes,
                               preferred_element_type=jnp.float32)
        parts.append(round_to(p, accum))
    return _accumulate(jnp.stack(parts, axis=-1), accum).astype(out)
