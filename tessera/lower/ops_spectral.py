"""Lowerings of the spectral ops (tessera/ir/ops_spectral.py) with `jnp.fft`: each transform over the axes of
its named dims, the result's dims renamed as the IR types say (an XLA FFT; its gradient is JAX's). The mixture of
spectral experts is tessera/lower/reference/spectral.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.context import jnp_dtype
from tessera.lower.named import align, names
from tessera.lower.reference import spectral as spectral_ref
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


@lowers("spectral_conv")
def _spectral_conv(ctx, op, attrs, ins, params):
    have = names(op.values[0])
    x = ins[0]
    axis, chan = have.index(attrs["over"].name), have.index(attrs["channels"].name)
    n, k = x.shape[axis], attrs["modes"]
    cdt = jnp.complex128 if x.dtype == jnp.float64 else jnp.complex64
    w = jax.lax.complex(params["w_re"].astype(x.real.dtype), params["w_im"].astype(x.real.dtype)).astype(cdt)
    f = jax.lax.slice_in_dim(jnp.fft.rfft(x, axis=axis), 0, k, axis=axis)  # the k lowest modes
    f = jnp.moveaxis(f, (axis, chan), (-2, -1))                             # [..., modes, channels]
    y = jnp.einsum("...mc,mco->...mo", f, w, preferred_element_type=cdt)
    y = jnp.moveaxis(y, (-2, -1), (axis, chan))
    return [_cast(op, jnp.fft.irfft(y, n=n, axis=axis))]                   # modes above k: zero


@lowers("spectral_moe")
def _spectral_moe(ctx, op, attrs, ins, params):
    have = names(op.values[0])
    over, chan = attrs["over"].name, attrs["channels"].name
    samples = tuple(n for n in have if n not in (over, chan))
    x = align(ins[0], have, samples + (over, chan))                        # [samples..., n, c]
    lead = x.shape[:len(samples)]
    y = spectral_ref.spectral_moe(x.reshape((-1,) + x.shape[-2:]), router=params["router"],
                                  router_bias=params.get("router_bias"), w_re=params["experts/w_re"],
                                  w_im=params["experts/w_im"], modes=attrs["modes"], top_k=attrs["top_k"],
                                  bands=attrs["bands"], accum=ctx.accum_dtype)
    return [_cast(op, align(y.reshape(lead + y.shape[-2:]), samples + (over, chan), have))]
