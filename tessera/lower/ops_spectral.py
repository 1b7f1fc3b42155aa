"""Lowerings of the spectral ops (tessera/ir/ops_spectral.py) with `jnp.fft`: each transform over the axes of
its named dims, the result's dims renamed as the IR types say (an XLA FFT; its gradient is JAX's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.context import jnp_dtype
from tessera.lower.named import names
from tessera.lower.table import lowers


def _axes(op, attrs) -> tuple[int, ...]:
    have = names(op.values[0])
    return tuple(have.index(d.name) for d in attrs["over"])


def _cast(op, x):
    return x.astype(jnp_dtype(op.results[0].type.dtype))


@lowers("fft")
def _fft(ctx, op, attrs, ins, params):
    return [_cast(op, jnp.fft.fftn(ins[0], axes=_axes(op, attrs), norm=attrs["norm"]))]


@lowers("ifft")
def _ifft(ctx, op, attrs, ins, params):
    return [_cast(op, jnp.fft.ifftn(ins[0], axes=_axes(op, attrs), norm=attrs["norm"]))]


@lowers("rfft")
def _rfft(ctx, op, attrs, ins, params):
    return [_cast(op, jnp.fft.rfftn(ins[0], axes=_axes(op, attrs), norm=attrs["norm"]))]


@lowers("irfft")
def _irfft(ctx, op, attrs, ins, params):
    sizes = tuple(d.size for d in attrs["to"])
    return [_cast(op, jnp.fft.irfftn(ins[0], s=sizes, axes=_axes(op, attrs), norm=attrs["norm"]))]


@lowers("modes")
def _modes(ctx, op, attrs, ins, params):
    axis = names(op.values[0]).index(attrs["dim"].name)
    return [jax.lax.slice_in_dim(ins[0], 0, attrs["keep"], axis=axis)]


@lowers("real")
def _real(ctx, op, attrs, ins, params):
    return [_cast(op, jnp.real(ins[0]))]


@lowers("imag")
def _imag(ctx, op, attrs, ins, params):
    return [_cast(op, jnp.imag(ins[0]))]


@lowers("complex")
def _complex(ctx, op, attrs, ins, params):
    return [_cast(op, jax.lax.complex(ins[0], ins[1]))]
