"""A mixture of spectral experts (the `spectral_moe` op): a Fourier layer whose mode weights are chosen per band.

Samples x [T, n, c] (callers flatten every dim but the transformed one and the channels). The `modes` lowest
Fourier modes f = rfft(x)[:modes] [modes, c] of a sample split into `bands` bands of equal width; a band's
router input is the log of its mean power per channel, log(mean |f|^2 over the band's modes) [c], which a
shift of x leaves alone. Routing is the `moe` op's (reference/moe.py `route`), each (sample, band) a token:
logits = input @ router + router_bias [E], the top_k logits (ties to the lower expert id) softmaxed among
themselves. Each chosen expert's complex weight W_e = w_re[e] + i w_im[e] [modes, c, c_out], restricted to the
band's modes, mixes them, and the results are summed with the routing weights:

    y[band] = sum_j weight_j * einsum("mc,mco->mo", f[band], W_{e_j}[band])      y = irfft(y), modes above zero

Each (sample, band, chosen expert) copy reads its own expert's weights (the unsorted form of reference/moe.py
`moe_pairs`): O(T * top_k) mode mixing whatever the number of experts; the gradient of the weights is a
scatter-add into the experts chosen. Routing weights are fp32 (f64 for f64); transforms run in x's precision.
Routing is differentiated by the softmax's own rule (reference/moe.py `route_smooth`), which compiles to the
same arithmetic on every mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.lower.reference import moe as moe_ref


def complex_of(dtype):
    """The complex type whose parts are `dtype` (f64 -> c128, else c64)."""
    return jnp.complex128 if dtype == jnp.float64 else jnp.complex64


def band_power(f, bands: int):
    """The router's input: log of the mean power |f|^2 over each band's modes, per channel: f [T, m, c] complex
    -> [T, bands, c] real (the smallest normal number added: a band of zeros gives a finite input)."""
    t, m, c = f.shape
    power = (jnp.real(f) ** 2 + jnp.imag(f) ** 2).reshape(t, bands, m // bands, c).mean(axis=2)
    return jnp.log(power + jnp.finfo(power.dtype).tiny)


def mix(f, w, experts, weights):
    """Band modes f [T, B, mb, c] (complex) through each band's k experts (experts [T, B, k]) of weights
    w [E, B, mb, c, o], summed with weights [T, B, k] -> [T, B, mb, o]."""
    chosen = w[experts, jnp.arange(w.shape[1])[None, :, None]]                  # [T, B, k, mb, c, o]
    per_copy = jnp.einsum("tbmc,tbkmco->tbkmo", f, chosen, preferred_element_type=f.dtype)
    return jnp.einsum("tbkmo,tbk->tbmo", per_copy, weights.astype(f.dtype))


def spectral_moe(x, *, router, router_bias, w_re, w_im, modes: int, top_k: int, bands: int = 1, accum=None):
    """x [T, n, c] (f32 or f64) -> [T, n, c_out] in x's type; see the module doc."""
    t, n, c = x.shape
    e, o = w_re.shape[0], w_re.shape[-1]
    f = jnp.fft.rfft(x, axis=1)[:, :modes].astype(complex_of(x.dtype))         # [T, modes, c]: the lowest modes
    r = band_power(f, bands).astype(x.dtype).reshape(t * bands, c)             # a token per (sample, band)
    weights, experts = moe_ref.route_smooth(r, router, router_bias, top_k, accum)  # moe's routing (its docstring)
    w = jax.lax.complex(w_re.astype(x.dtype), w_im.astype(x.dtype)).reshape(e, bands, modes // bands, c, o)
    y = mix(f.reshape(t, bands, modes // bands, c), w, experts.reshape(t, bands, top_k),
            weights.reshape(t, bands, top_k))
    return jnp.fft.irfft(y.reshape(t, modes, o), n=n, axis=1).astype(x.dtype)  # [T, n, c_out]; higher modes zero
