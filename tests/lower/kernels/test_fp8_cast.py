"""The one-pass e5m2 casts of a gradient (kernels/fp8_cast.py) on the interpreter against their references
(reference/fp8_cast.py, the numbers the fp8 products' own quantisation gives): codes in both layouts, amaxes and
delayed scales, on a first step (empty histories: the scale from the gradient's amax, the reduce-only pass) and a
later one (the scale from the history alone), over several tiles; the shapes the kernels refuse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.kernels.fp8_cast import CastConfig, cast_transpose_delayed, fitted, supported, \
    swiglu_grad_delayed
from tessera.lower.reference import fp8_cast as ref

CONFIG = CastConfig(bm=16, bn=32, amax_bm=32, amax_bn=64, interpret=True)


def _codes(x) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8)).astype(np.int32)


def _rows(first: bool, ranges) -> jax.Array:
    rows = jnp.zeros((len(ranges), 8), jnp.float32)
    return rows if first else rows.at[:, 2].set(jnp.asarray(ranges, jnp.float32))


def _swiglu_inputs(seed: int, m: int = 64, f: int = 128):
    k = jax.random.split(jax.random.key(seed), 3)
    gate = jax.random.normal(k[0], (m, f), jnp.bfloat16) * 2
    up = jax.random.normal(k[1], (m, f), jnp.bfloat16)
    dh = (1e-4 * jax.random.normal(k[2], (m, f))).astype(jnp.bfloat16)
    return dh, gate, up


@pytest.mark.parametrize("first", [True, False], ids=["first step", "history"])
def test_swiglu_gradients_are_the_references_codes_both_ways(first):
    dh, gate, up = _swiglu_inputs(seed=3 if first else 4)
    # a history range below the gradients' amax (saturating codes) for gate, above it for up
    rows = _rows(first, [2e-4, 3e-3])
    h_scale = jnp.float32(2.0 ** 6)  # h's codes saturate where |h| >= 7 (38 of the 8192 here)
    got = jax.jit(lambda *a: swiglu_grad_delayed(*a, config=CONFIG))(dh, gate, up, rows, h_scale)
    want = jax.jit(ref.swiglu_grad_delayed)(dh, gate, up, rows, h_scale)
    for i in range(4):  # gate, gate.T, up, up.T: exact on the CPU, where nothing contracts a multiply-add
        assert got[i].shape == want[i].shape and got[i].dtype == jnp.float8_e5m2
        np.testing.assert_array_equal(_codes(got[i]), _codes(want[i]))
    np.testing.assert_array_equal(_codes(got[1]), _codes(got[0]).T)
    for a, w in zip(got[4:8], want[4:8]):  # amaxes, scales
        assert float(a) == float(w) > 0
    # h = swiglu(gate, up) again, as the down product's forward codes it (e4m3, its scale), transposed [F, M]
    assert got[8].shape == (128, 64) and got[8].dtype == jnp.float8_e4m3fn and len(got) == len(want) == 10
    np.testing.assert_array_equal(_codes(got[8]), _codes(want[8]))
    h = np.asarray(ref.swiglu_rounded(gate, up))
    big = np.abs(h) * 64 >= 448
    assert big.sum() > 10 and np.all(np.asarray(got[8].T, np.float32)[big] == np.sign(h[big]) * 448)
    assert float(got[9]) == float(want[9]) == np.abs(h).max() > 7  # h's amax, for the down product's input history
    if first:  # the scales from the gradients' own amaxes: the largest code just under e5m2's max
        assert 28672 <= float(want[4]) * float(want[6]) <= 57344
    else:
        assert float(got[6]) == 2.0 ** 28 and float(got[7]) == 2.0 ** 24  # 57344 / 2e-4, / 3e-3, as powers of 2


def test_a_plain_gradient_is_the_references_codes_both_ways():
    g = (1e-6 * jax.random.normal(jax.random.key(5), (64, 192))).astype(jnp.bfloat16)
    for first in (True, False):
        row = _rows(first, [3e-6])[0]
        got = jax.jit(lambda g, r: cast_transpose_delayed(g, r, config=fitted(64, 192, CONFIG)))(g, row)
        want = jax.jit(ref.cast_transpose_delayed)(g, row)
        np.testing.assert_array_equal(_codes(got[0]), _codes(want[0]))
        np.testing.assert_array_equal(_codes(got[1]), _codes(want[0]).T)
        assert float(got[2]) == float(want[2]) and float(got[3]) == float(want[3])


def test_the_tiles_fit_the_shape_or_the_kernel_refuses():
    x = jnp.zeros((64, 192), jnp.bfloat16)
    assert fitted(64, 192, CONFIG) == CastConfig(bm=16, bn=64 // 2, amax_bm=32, amax_bn=64, interpret=True)
    assert fitted(16384, 8192) == CastConfig()
    assert fitted(24, 128) is None  # no power of two >= 16 divides 24
    assert supported(x, config=fitted(64, 192, CONFIG)) is True
    assert supported(x, config=CastConfig(bm=128, interpret=True)) is False  # 64 rows: not a whole tile
    assert supported(x, jnp.zeros((64, 96), jnp.bfloat16), config=CONFIG) is False  # shapes differ
    assert supported(x.astype(jnp.int8), config=CONFIG) is False
    if jax.default_backend() != "gpu":
        assert supported(x, config=fitted(64, 192)) is False  # the compiled kernel needs a GPU


# weight products as the layers make them: an MLP's (held weight, as the train step's scan holds it), attention's q
# and o projections, the tied unembedding ([vocab, embed])
PRODUCTS = {"mlp": ("bse,ef->bsf", (2, 16, 32), (32, 64)), "q": ("bse,ehd->bshd", (2, 16, 32), (32, 4, 16)),
            "o": ("bshd,hde->bse", (2, 16, 4, 16), (4, 16, 32)), "unembed": ("bse,ve->bsv", (2, 16, 32), (96, 32))}


@pytest.mark.parametrize("name", PRODUCTS)
def test_a_delayed_products_gradients_through_the_kernel_are_its_own(name):
    """fp8.einsum's `cast` (the kernel writing the gradient's codes in both layouts, the weight gradient reading
    the transposed ones): the input and weight gradients and the history's record bit for bit as the product's own
    quantisation gives them, on a first step and a later one."""
    from tessera.lower.reference import fp8

    spec, xs, ws = PRODUCTS[name]
    k = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(k[0], xs, jnp.bfloat16)
    w = (0.1 * jax.random.normal(k[1], ws)).astype(jnp.bfloat16)
    m, n = fp8.gradient_matrix(spec, xs, ws)
    cot = (1e-5 * jax.random.normal(k[2], (m, n))).astype(jnp.bfloat16)
    cast = lambda g, row: cast_transpose_delayed(g, row, config=fitted(m, n, CONFIG))  # noqa: E731
    for history in (jnp.zeros((3, 4)), jnp.zeros((3, 4)).at[:, 1].set(jnp.asarray([3.0, 0.2, 4e-5]))):
        held = fp8.hold(w, jnp.bfloat16, history, lead=1) if name == "mlp" else None

        def grads(c):
            def f(x, w, h):
                return fp8.einsum(spec, x, w, accum=jnp.float32, preferred_element_type=jnp.bfloat16,
                                  scaling="delayed(4)", history=h, held=held, cast=c)
            y, vjp = jax.vjp(f, x, w, history)
            return (y, *vjp(cot.reshape(y.shape)))
        got, want = jax.jit(lambda: grads(cast))(), jax.jit(lambda: grads(None))()
        for a, b in zip(got, want):  # the output, dx, dw, the history's record
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert float(jnp.max(jnp.abs(got[2].astype(jnp.float32)))) > 0 and float(got[3][2, 0]) > 0
