"""The block-scaled fp8 matrix-vector kernel (fp8_gemv) against the exact product of the dequantised weights and
the reference (reference.fp8_blocks.weight_only_einsum), on the interpreter: every layout it reads (a scale a
row folded into x, a scale row a code row, one a block of rows), split K, loads ahead; its e4m3 conversion
bitwise on a PTX emulator; the layouts it refuses say why."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tessera.lower.kernels.fp8_gemv import _E4M3_PTX, Fp8GemvConfig, e4m3_f32, layout, splits_for, supported, \
    weight_only_einsum
from tessera.lower.reference import fp8_blocks as fb
from tests.lower.kernels.test_mxfp4_matmul import _run_ptx

# (spec, x shape, W shape, block): GPT-OSS's q (one scale a row: B covers heads and head_dim), its k/v (a scale
# row a code row), its o (a scale row a block of code rows) and a dense [K, N] weight, at test sizes
CASES = {"q": ("btd,dhk->bthk", (1, 1, 96), (96, 16, 16), 16),
         "kv": ("btd,dhk->bthk", (1, 1, 96), (96, 4, 16), 4),
         "o": ("bthk,hkd->btd", (1, 1, 4, 16), (4, 16, 96), 16),
         "dense": ("bse,ef->bsf", (1, 1, 64), (64, 96), 32)}
CONFIGS = {"one split": Fp8GemvConfig(block_n=32, rows=4, splits=1, ahead=0, interpret=True),
           "split, ahead 2": Fp8GemvConfig(block_n=64, rows=8, splits=3, ahead=2, interpret=True)}


def _operands(case: str, seed: int):
    spec, xs, ws, block = CASES[case]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(xs), jnp.bfloat16)
    rows = rng.uniform(0.05, 4.0, ws[:1] + (1,) * (len(ws) - 1))  # blocks of different ranges
    return spec, x, fb.quantize(jnp.asarray(rng.standard_normal(ws) * rows, jnp.float32), block)


# each case one jit of the interpreted kernel (~1 s of CPU): every layout once, each config on two of them
@pytest.mark.parametrize("case,config", [("q", "one split"), ("kv", "split, ahead 2"), ("o", "split, ahead 2"),
                                         ("dense", "one split")])
def test_the_kernel_is_the_exact_product_of_the_dequantised_weights(case, config):
    spec, x, w = _operands(case, seed=len(case) + len(config))
    cfg = CONFIGS[config]
    assert supported(spec, x, w, config=cfg) is True
    got = jax.jit(lambda x, w: weight_only_einsum(spec, x, w, out_dtype=jnp.float32, config=cfg))(x, w)
    exact = np.einsum(spec, np.asarray(x, np.float64), np.asarray(fb.dequantize(w, jnp.float32), np.float64))
    reference = fb.weight_only_einsum(spec, x, w, compute_dtype=jnp.bfloat16, out_dtype=jnp.float32)
    assert got.shape == reference.shape == exact.shape and got.dtype == jnp.float32
    scale = np.max(np.abs(exact))
    assert np.max(np.abs(np.asarray(got, np.float64) - exact)) < 2e-6 * scale  # fp32 sums of exact products
    # the reference rounds each weight to bf16 first (2^-9 relative): it sits that far off, the kernel not
    ref_err = np.max(np.abs(np.asarray(reference, np.float64) - exact))
    assert 1e-5 * scale < ref_err < 1e-2 * scale


def test_a_bf16_result_is_the_fp32_result_rounded():
    spec, x, w = _operands("o", seed=7)
    cfg = CONFIGS["one split"]
    f32 = weight_only_einsum(spec, x, w, out_dtype=jnp.float32, config=cfg)
    b16 = weight_only_einsum(spec, x, w, out_dtype=jnp.bfloat16, config=cfg)
    assert b16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(b16), np.asarray(f32.astype(jnp.bfloat16)))


def test_layouts_it_refuses_say_why():
    spec, x, w = _operands("q", seed=0)
    two = jnp.concatenate([x, x], axis=1)
    assert supported(spec, two, w, config=CONFIGS["one split"]) == "more than one token"
    _, xo, wo = _operands("dense", seed=0)
    assert supported("bsf,ef->bse", jnp.zeros((1, 1, 96)), wo, config=CONFIGS["one split"]) \
        == "the contracted dims are not W's leading dims"
    assert supported("bse,ef->bsf", xo, jnp.zeros((64, 96)), config=CONFIGS["one split"]) is False  # not fp8
    # the o view's scale rows cover 16 code rows: 32 rows a step would straddle two
    _, xo, wo = _operands("o", seed=0)
    assert "do not divide" in supported("bthk,hkd->btd", xo, wo, config=Fp8GemvConfig(rows=32, interpret=True))
    # no GPU here: the compiled kernel is refused, with the reason
    if jax.devices()[0].platform == "cpu":
        assert "compute capability" in supported(spec, x, w)


def test_layout_and_splits():
    _, x, w = _operands("kv", seed=0)
    lay = layout("btd,dhk->bthk", x.shape, w)
    assert (lay.k, lay.n, lay.row_block, lay.row_stride, lay.n_inner, lay.fold) == (96, 64, 1, 4, 16, False)
    _, x, w = _operands("o", seed=0)
    lay = layout("bthk,hkd->btd", x.shape, w)
    assert (lay.k, lay.n, lay.row_block, lay.row_stride, lay.fold) == (64, 96, 16, 6, False)
    assert layout("btd,dhk->bthk", (1, 1, 96), _operands("q", 0)[2]).fold
    # ~programs programs: 2880 -> 4096 at 1024 columns is 4 tiles, so 132 splits of 360 8-row steps -> 120
    big = Fp8GemvConfig()
    lay = layout("btd,dhk->bthk", (1, 1, 2880), fb.abstract((2880, 64, 64), 64))
    assert splits_for(lay, big) == 120 and -(-360 // splits_for(lay, big)) == 3


def test_e4m3_ptx_is_bitwise_ml_dtypes_on_an_emulator():
    """`_E4M3_PTX` (four code bytes a register -> four fp32 values): every byte in every position gives
    ml_dtypes' float8_e4m3fn value (NaNs as NaNs), and the interpreter's jnp route the same bits."""
    rng = np.random.default_rng(5)
    b = np.stack([np.arange(256, dtype=np.uint32)] + [rng.permutation(256).astype(np.uint32) for _ in range(3)])
    for pos in range(4):
        rolled = np.roll(b, pos, axis=0)
        out = _run_ptx(_E4M3_PTX, {"$4": rolled[0] | rolled[1] << 8 | rolled[2] << 16 | rolled[3] << 24})
        want = rolled.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        got = np.stack([out[f"${i}"] for i in range(4)]).view(np.float32)
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
        via_jnp = np.asarray(e4m3_f32(jnp.asarray(rolled.astype(np.uint8)), ptx=False))
        np.testing.assert_array_equal(np.isnan(via_jnp), nan)
        np.testing.assert_array_equal(via_jnp[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_kernel_is_the_exact_product_and_its_conversion_bitwise(case):
    """Compiled (inline PTX, default config): every layout within fp32 summation of the exact product; every
    e4m3 byte converted to ml_dtypes' value."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    spec, x, w = _operands(case, seed=11)
    assert supported(spec, x, w) is True
    got = jax.jit(lambda x, w: weight_only_einsum(spec, x, w, out_dtype=jnp.float32))(x, w)
    exact = np.einsum(spec, np.asarray(x, np.float64), np.asarray(fb.dequantize(w, jnp.float32), np.float64))
    assert np.max(np.abs(np.asarray(got, np.float64) - exact)) < 2e-6 * np.max(np.abs(exact))
    codes = jnp.arange(256 * 16, dtype=jnp.int32).astype(jnp.uint8).reshape(64, 64)

    def body(c_ref, o_ref):
        o_ref[...] = e4m3_f32(c_ref[...], ptx=True)
    out = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                         compiler_params=pltriton.CompilerParams(num_warps=4))(codes)
    want = np.asarray(codes).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(np.asarray(out)), nan)
    np.testing.assert_array_equal(np.asarray(out)[~nan], want[~nan])
