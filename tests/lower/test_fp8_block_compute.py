"""fp8 compute with per-block scaling (`numerics.default: fp8_e4m3 @scale(per_block(N))`, DeepSeek-V3 style;
tessera/lower/reference/fp8_per_block.py): activations in 1×N blocks along the contraction, weights in N×N
blocks, power-of-two scales, each block's product in fp32 summed over K blocks in order; the backward's e5m2
gradient in 1×N blocks along the output features. Forward and both gradients, dense and the experts' grouped
product, match a numpy model of that arithmetic; per-block beats per-tensor where one block holds an outlier; a tiny Llama trains close to bf16;
`tessera check` refuses what would not run as written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tessera.lower.reference import fp8, fp8_per_block
from tessera.spec import load_experiment
from tests.lower.shard.make_snapshots import ROOT
from tests.lower.test_fp8_compute import ARGS, _train

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _scale(amax, t):
    big = float(ml_dtypes.finfo(t).max)
    return np.where(amax > 0, 2.0 ** np.floor(np.log2(big / np.where(amax > 0, amax, 1.0))), 1.0)


def _rows(x, n, t):
    """numpy model: x [M, K] in 1×n blocks along K → (dequantised-free codes as float64 [M, K], scales [M, K/n])."""
    m, k = x.shape
    xb = x.astype(np.float64).reshape(m, k // n, n)
    s = _scale(np.abs(xb).max(-1), t)
    return (xb * s[..., None]).astype(t).astype(np.float64).reshape(m, k), s


def _tiles(w, n, t):
    k, f = w.shape
    wb = w.astype(np.float64).reshape(k // n, n, f // n, n)
    s = _scale(np.abs(wb).max((1, 3)), t)
    return (wb * s[:, None, :, None]).astype(t).astype(np.float64).reshape(k, f), s


def _blocked(aq, sa, bq, sb, n):
    """Σ_kb (aq[:, kb] @ bq[kb, :]) / (sa[:, kb] · sb[kb, fb])."""
    y = 0.0
    for kb in range(aq.shape[1] // n):
        part = aq[:, kb * n:(kb + 1) * n] @ bq[kb * n:(kb + 1) * n]
        y = y + part / (sa[:, kb][:, None] * np.repeat(sb[kb], n)[None, :])
    return y


def _data(seed=0, m=6, k=64, f=64):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, f)) * 0.02).astype(np.float32)
    g = rng.standard_normal((m, f)).astype(np.float32)
    return x, w, g


def _run(x, w, g, scaling, out=jnp.float32):
    """(y, dx, dw) of the fp8 product x ⊗ w with incoming gradient g, in one compiled program."""
    def f(a, b, c):
        y, vjp = jax.vjp(lambda a, b: fp8.einsum("mk,kf->mf", a, b, accum=jnp.float32, preferred_element_type=out,
                                                 scaling=scaling), a, b)
        return (y, *vjp(c))
    return [np.asarray(t) for t in jax.jit(f)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))]


def test_the_blocked_product_and_its_gradients_are_the_blocked_fp8_arithmetic():
    n = 32
    x, w, g = _data()
    x[:, :32] *= 50.0  # the two K blocks of each row differ in range: their scales differ
    y, dx, dw = _run(x, w, g, f"per_block({n})")
    (xq, sx), (wq, sw) = _rows(x, n, E4M3), _tiles(w, n, E4M3)
    assert sx.shape == (6, 2) and sw.shape == (2, 2) and (sx[:, 0] < sx[:, 1]).all()
    want = _blocked(xq, sx, wq, sw, n)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    exact = x.astype(np.float64) @ w
    assert np.abs(np.asarray(y) - exact).max() > 1e-3 * np.abs(exact).max()  # the fp8 rounding is there
    gq, sg = _rows(g, n, E5M2)  # 1×N blocks along the output features (dx's contraction)
    want_dx = _blocked(gq, sg, wq.T, sw.T, n)  # (fp32 sums against exact ones: a few fp32 ulps of the largest)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-6, atol=1e-6 * np.abs(want_dx).max())
    xd, gd = xq / np.repeat(sx, n, 1), gq / np.repeat(sg, n, 1)  # the forward's codes, rescaled exactly
    want_dw = xd.T @ gd
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-6, atol=1e-6 * np.abs(want_dw).max())
    # and it is not the per-tensor arithmetic
    y_t = _run(x, w, g, "per_tensor")[0]
    assert not np.array_equal(np.asarray(y), np.asarray(y_t))


def test_scales_are_powers_of_two_bringing_each_block_just_under_the_format_max():
    x, w, _ = _data(1)
    x[2, 40] = 0.0
    x[3, 32:] = 0.0  # an all-zero block gets scale 1
    xq, sx = fp8_per_block.quantize_rows(jnp.asarray(x), 32, jnp.float8_e4m3fn)
    wq, sw = fp8_per_block.quantize_tiles(jnp.asarray(w), 32, jnp.float8_e4m3fn)
    for s in (np.asarray(sx), np.asarray(sw)):
        assert np.array_equal(np.exp2(np.round(np.log2(s))), s)
    assert float(sx[3, 1]) == 1.0
    amax = np.abs(np.asarray(xq, np.float32)).reshape(6, 2, 32).max(-1)
    live = amax > 0
    assert ((amax[live] > 448 / 2 * 0.9) & (amax[live] <= 448)).all()
    assert np.abs(np.asarray(wq, np.float32)).reshape(2, 32, 2, 32).max((1, 3)).min() > 448 / 2 * 0.9


def test_an_outlier_in_one_block_costs_per_tensor_precision_that_per_block_keeps():
    x, w, g = _data(2, m=16, k=128, f=64)
    # one block of one row (and of the gradient) holds an outlier: scaled per tensor, every other value falls into
    # the format's subnormals (e4m3 below 2^-6, e5m2 below 2^-14) or under them, losing its mantissa; per block it keeps it.
    # (Where a per-tensor scale leaves values normal, power-of-two scales round alike per tensor and per block.)
    x[0, 5] = 1e6
    g[0, 7] = 1e10
    exact_y, exact_dx = x.astype(np.float64) @ w, g.astype(np.float64) @ w.T
    err = {}
    for scaling in ("per_tensor", "per_block(32)"):
        y, dx, _ = _run(x, w, g, scaling)
        # the rows without the outlier
        err[scaling, "y"] = np.linalg.norm(y[1:] - exact_y[1:]) / np.linalg.norm(exact_y[1:])
        err[scaling, "dx"] = np.linalg.norm(dx[1:] - exact_dx[1:]) / np.linalg.norm(exact_dx[1:])
    assert err["per_block(32)", "y"] < err["per_tensor", "y"] / 4, err
    assert err["per_block(32)", "dx"] < err["per_tensor", "dx"] / 4, err
    assert err["per_block(32)", "y"] < 0.05 and err["per_block(32)", "dx"] < 0.1, err  # e4m3's 3 bits, e5m2's 2


def test_products_with_several_contracted_and_kept_dims_flatten_in_the_weights_order():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4, 16)).astype(np.float32)  # [b, s, h, d] ⊗ o [h, d, e]: K = h·d = 64
    w = (rng.standard_normal((4, 16, 32)) * 0.05).astype(np.float32)
    y = fp8.einsum("bshd,hde->bse", jnp.asarray(x), jnp.asarray(w), accum=jnp.float32,
                   preferred_element_type=jnp.float32, scaling="per_block(32)")
    (xq, sx), (wq, sw) = _rows(x.reshape(6, 64), 32, E4M3), _tiles(w.reshape(64, 32), 32, E4M3)
    np.testing.assert_allclose(np.asarray(y).reshape(6, 32), _blocked(xq, sx, wq, sw, 32), rtol=1e-6, atol=1e-9)
    xs = rng.standard_normal((2, 3, 32)).astype(np.float32)  # [b, s, e] ⊗ q [e, h, d]: kept h·d = 64
    wq_ = (rng.standard_normal((32, 4, 16)) * 0.05).astype(np.float32)
    yq = fp8.einsum("bse,ehd->bshd", jnp.asarray(xs), jnp.asarray(wq_), accum=jnp.float32,
                    preferred_element_type=jnp.float32, scaling="per_block(32)")
    (aq, sa), (bq, sb) = _rows(xs.reshape(6, 32), 32, E4M3), _tiles(wq_.reshape(32, 64), 32, E4M3)
    np.testing.assert_allclose(np.asarray(yq).reshape(6, 64), _blocked(aq, sa, bq, sb, 32), rtol=1e-6, atol=1e-9)


def test_the_experts_grouped_product_is_the_blocked_fp8_arithmetic():
    n = 32
    rng = np.random.default_rng(4)
    lhs, rhs, g = rng.standard_normal((10, 64)), rng.standard_normal((3, 64, 64)) * 0.02, rng.standard_normal((10, 64))
    lhs[:, 40:] *= 30.0  # the K blocks of each row differ in range
    sizes = jnp.asarray([4, 0, 5], jnp.int32)  # the last row belongs to no group

    def f(a, b, c):
        y, vjp = jax.vjp(lambda a, b: fp8.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32,
                                                     scaling=f"per_block({n})"), a, b)
        return (y, *vjp(c))
    y, dl, dr = (np.asarray(t) for t in jax.jit(f)(*(jnp.asarray(t, jnp.float32) for t in (lhs, rhs, g))))
    lq, sl = _rows(lhs.astype(np.float32), n, E4M3)
    gq, sg = _rows(g.astype(np.float32), n, E5M2)
    ld, gd = lq / np.repeat(sl, n, 1), gq / np.repeat(sg, n, 1)
    want, want_dl, want_dr = np.zeros((10, 64)), np.zeros((10, 64)), np.zeros(rhs.shape)
    for e, r in {0: slice(0, 4), 2: slice(4, 9)}.items():
        rq, sr = _tiles(rhs[e].astype(np.float32), n, E4M3)
        want[r] = _blocked(lq[r], sl[r], rq, sr, n)
        rd = rq / np.repeat(np.repeat(sr, n, 0), n, 1)
        want_dl[r] = gd[r] @ rd.T
        want_dr[e] = ld[r].T @ gd[r]
    for got, ref in ((y, want), (dl, want_dl), (dr, want_dr)):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    assert not np.any(y[9]) and not np.any(dl[9]) and not np.any(dr[1])


@pytest.fixture(scope="module")
def runs():
    return {"bf16": _train("bf16 @accum(fp32)"), "block": _train("fp8_e4m3 @scale(per_block(16))")}


def test_a_tiny_llama_trains_in_per_block_fp8_close_to_bf16(runs):
    bf16, block = runs["bf16"][3], runs["block"][3]
    assert block[-1] < block[0] - 0.2  # it trains
    np.testing.assert_allclose(block, bf16, rtol=1e-2)
    assert not np.array_equal(block, bf16)  # and the products did run in fp8
    prog, state, batch, _ = runs["block"]
    text = str(jax.make_jaxpr(prog.train_step_fn())(state, batch))
    assert text.count("new_dtype=float8_e4m3fn") >= 2 * 7 and text.count("new_dtype=float8_e5m2") >= 7


def test_the_resolved_policy_names_the_block_scaling():
    from tessera.ir.check import check_experiment
    from tessera.ir.passes.numerics import resolved_policy

    exp = load_experiment(str(ROOT / "specs" / "llama_tiny.yaml"), overrides={
        "numerics.default": "fp8_e4m3 @scale(per_block(32))"})
    graph = check_experiment(exp)
    policy = resolved_policy(graph, exp.numerics)
    assert policy["fp8_products"] == "per_block(32)"
    assert policy["by_param"]["layers/mlp/gate"]["compute"] == "fp8_e4m3"


@pytest.mark.parametrize("spec, over, says, hint", [
    ("llama_tiny.yaml", {"numerics.default": "fp8_e4m3 @scale(per_block(32))", **{f"model.args.{k}": v for k, v in
                                                                                 ARGS.items()}},
     "parameter `layers/attention/k` (declared at models/llama.tsl:8:13) has output dims kv_heads=2×head_dim=8 = 16, "
     "not a multiple of the block 32", "`fp8_e4m3 @scale(per_block(16))`"),
    ("llama_tiny.yaml", {"numerics.default": "fp8_e4m3 @scale(per_block(48))"},
     "has contracted dim embed=128 = 128, not a multiple of the block 48", "per_block(32)"),
    ("llama_tiny.yaml", {"numerics.default": "fp8_e4m3 @scale(per_block(32)) @accum(bf16)"},
     "accumulates each block's product in fp32; `@accum(bf16)` is not implemented", "per_block(32)"),
    ("gpt_oss_tiny.yaml", {"numerics.default": "fp8_e4m3 @scale(per_block(64))", "model.args.d_ff": 96},
     "parameter `layers/moe/experts/gate` (declared at models/gpt_oss.tsl:", "per_block(32)"),
])
def test_per_block_fp8_that_would_not_run_as_written_is_refused(spec, over, says, hint):
    from tessera.diagnostics import TesseraError
    from tessera.ir.check import check_experiment

    with pytest.raises(TesseraError) as err:
        check_experiment(load_experiment(str(ROOT / "specs" / spec), overrides=over))
    (d,) = err.value.diagnostics
    assert d.key == "numerics.default" and d.span is not None and says in d.message and hint in d.hint
