"""MXFP4 kernels vs the reference (reference.mxfp4): the grouped kernel (mxfp4_matmul: ragged and empty
experts, tail rows, split K) and the matrix-vector kernel for (token, expert) pairs (mxfp4_gemv); their
bit conversions bitwise, on the interpreter and on a PTX emulator.

The interpreter cases are as small as still reach each path: every jit compiles the interpreted kernel
(~2 s of CPU), so each case is one jit, its output and, where asked, d lhs together."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tessera.lower.kernels._tables import cumsum
from tessera.lower.kernels.mxfp4_gemv import GemvConfig, gemv_splits, pair_config, pair_halves
from tessera.lower.kernels.mxfp4_matmul import (Mxfp4Config, _tile_table, default_config, matmul, pair_dot,
                                                ragged_dot, ragged_dot_reference, supported, supported_pairs)
from tessera.lower.reference import mxfp4 as ref
from tests.lower.kernels._check import assert_close


def _inputs(seed, m, k, n, sizes):
    """bf16 lhs [M, K], random packed experts [G, K, N] (every E2M1 code, scales 2^-9..2^-4), int32 sizes."""
    rng = np.random.default_rng(seed)
    g = len(sizes)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    codes = rng.integers(0, 256, (g, k // 2, n), dtype=np.uint8)
    scales = rng.integers(118, 124, (g, k // 32, n), dtype=np.uint8)
    return lhs, ref.MXFP4(jnp.asarray(codes), jnp.asarray(scales)), jnp.asarray(sizes, jnp.int32)


@jax.jit
def _want(lhs, rhs, sizes):
    return ragged_dot_reference(lhs.astype(jnp.float32), rhs, sizes)


def _weights(rhs, experts) -> np.ndarray:
    """float64 [R, K, N]: the dequantised weights (the reference's) of experts[r] for each r."""
    return np.asarray(ref.dequantize(rhs, jnp.float32), np.float64)[np.asarray(experts)]


def _row_experts(sizes, m) -> np.ndarray:
    """The group of each of m rows (-1 past sum(sizes))."""
    return np.concatenate([np.full(s, g) for g, s in enumerate(sizes)] + [np.full(m - sum(sizes), -1)])


def _run_and_grad(fn, lhs, ct, grad: bool):
    """One jit: fn(lhs), and d <fn(lhs), ct> / d lhs where `grad`."""
    def both(x):
        if not grad:
            return fn(x), None
        out, vjp = jax.vjp(fn, x)
        return out, vjp(ct.astype(out.dtype))[0]
    return jax.jit(both)(lhs)


def test_cumsum_is_numpy_cumsum():
    x = np.random.default_rng(0).integers(0, 50, 37).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(cumsum(jnp.asarray(x))), np.cumsum(x))


@pytest.mark.parametrize("sizes,m,bm", [
    ([3, 0, 40, 17, 0, 1], 70, 16),  # runs straddling tiles, rows past sum(sizes)
    ([0, 1, 0, 0, 1, 0, 0, 0, 1, 1] + [0] * 110, 4, 16),  # decode: 120 experts, 4 of them hold a row
    ([5, 5, 5, 5], 20, 4),  # every group exactly whole tiles
])
def test_tile_table_covers_every_row_once(sizes, m, bm):
    """Each row up to m lands in exactly one run of its own group (tail rows: group G), and the table
    has cdiv(m, bm) + min(G, m) + 1 entries however many groups are empty."""
    table = np.asarray(jax.jit(_tile_table, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), m, bm))
    assert table.shape == (-(-m // bm) + min(len(sizes), m) + 1, 3)
    owner = np.full(m, -1)
    for grp, row0, rows in table:
        assert 0 <= rows <= bm
        assert (owner[row0:row0 + rows] == -1).all()
        owner[row0:row0 + rows] = grp
    want = _row_experts(sizes, m)
    np.testing.assert_array_equal(owner, np.where(want < 0, len(sizes), want))


GROUPED_CASES = [  # m, k, n, sizes, config, out dtype, d lhs
    # group 2 starts mid-tile and spans two runs, 4 tail rows, empty groups, N off the tile; 3 K steps
    # (the last half masked, as decode's 64-wide steps over K = 2880 are not) split 2 ways, loads two steps
    # ahead (those past a split's end masked off); fp32 out; d lhs through the custom VJP (the reference)
    (33, 160, 48, [9, 0, 20, 0],
     Mxfp4Config(block_m=16, block_n=32, block_k=64, splits=2, ahead=2, interpret=True), jnp.float32, True),
    # block_m < 16: the FMA path; one K split, so the kernel stores bf16 itself; a masked last step
    (7, 96, 32, [1, 0, 3, 2], Mxfp4Config(block_m=2, block_n=32, block_k=64, interpret=True), jnp.bfloat16, False),
]


@pytest.mark.parametrize("m,k,n,sizes,cfg,dtype,grad", GROUPED_CASES)
def test_interpret_ragged_dot(m, k, n, sizes, cfg, dtype, grad):
    """Interpreter: the grouped kernel against dequantised weights (float64), rows past sum(sizes) exactly 0."""
    lhs, rhs, gs = _inputs(m + k, m, k, n, sizes)
    ct = jax.random.normal(jax.random.key(9), (m, n), jnp.float32)
    out, dlhs = _run_and_grad(lambda x: ragged_dot(x, rhs, gs, preferred_element_type=dtype, config=cfg),
                              lhs, ct, grad)
    assert out.shape == (m, n) and out.dtype == dtype
    rows = _row_experts(sizes, m)
    w = _weights(rhs, np.maximum(rows, 0)) * (rows >= 0)[:, None, None]  # [M, K, N], tail rows zero
    x = np.asarray(lhs.astype(jnp.float32), np.float64)
    assert_close(out, np.einsum("mk,mkn->mn", x, w), 1e-5 if dtype == jnp.float32 else 1e-2, "out")
    assert float(jnp.abs(out[sum(sizes):].astype(jnp.float32)).max(initial=0.0)) == 0.0
    if grad:
        assert dlhs.dtype == lhs.dtype
        assert_close(dlhs, np.einsum("mn,mkn->mk", np.asarray(ct, np.float64), w), 1e-2, "dlhs")


def test_interpret_matmul():
    """matmul is the one-group case: 18 rows over two runs of 16, bf16 out."""
    lhs, rhs, _ = _inputs(3, 18, 64, 32, [0])
    w = ref.MXFP4(rhs.codes[0], rhs.scales[0])
    cfg = Mxfp4Config(block_m=16, block_n=32, block_k=32, interpret=True)
    out = jax.jit(lambda x: matmul(x, w, config=cfg))(lhs.reshape(2, 9, 64))
    assert out.shape == (2, 9, 32) and out.dtype == jnp.bfloat16
    want = np.asarray(lhs.astype(jnp.float32), np.float64) @ _weights(rhs, 0)
    assert_close(out.reshape(18, 32), want, 1e-2, "matmul")


PAIR_CASES = [  # experts, K, N, config, out dtype, d lhs
    # the matrix-vector kernel (E4M3 route): unsorted with repeats, R = 5, N off block_n, each of 2 K
    # splits one step (the load ahead masked off); fp32 out; d lhs through the custom VJP (the reference)
    ([3, 0, 3, 1, 3], 64, 48, GemvConfig(block_n=32, splits=2, interpret=True), jnp.float32, True),
    # two scale groups a step over K = 96: the last step half masked; loads in the step; the fp16-pair
    # route; one K split, so the kernel stores bf16 itself
    ([2, 0, 2], 96, 32, GemvConfig(block_n=32, groups=2, splits=1, ahead=0, dequant="pair", interpret=True),
     jnp.bfloat16, False),
    # the grouped kernel, each row its own run: split K, a masked last step, N off the tile
    ([1, 3, 1], 96, 48, Mxfp4Config(block_m=16, block_n=32, block_k=64, splits=2, interpret=True), jnp.float32,
     False),
]


@pytest.mark.parametrize("experts,k,n,cfg,dtype,grad", PAIR_CASES)
def test_interpret_pair_dot(experts, k, n, cfg, dtype, grad):
    """Interpreter: row r times expert experts[r], in any order and with repeats, against dequantised
    weights (float64)."""
    r = len(experts)
    lhs, rhs, _ = _inputs(r * k + n, r, k, n, [0] * 4)
    ex = jnp.asarray(experts, jnp.int32)
    assert supported_pairs(lhs, rhs, ex, cfg) and not supported_pairs(lhs, rhs, ex[:, None], cfg)
    ct = jax.random.normal(jax.random.key(2), (r, n), jnp.float32)
    out, dlhs = _run_and_grad(lambda x: pair_dot(x, rhs, ex, preferred_element_type=dtype, config=cfg),
                              lhs, ct, grad)
    assert out.shape == (r, n) and out.dtype == dtype
    w = _weights(rhs, experts)
    want = np.einsum("rk,rkn->rn", np.asarray(lhs.astype(jnp.float32), np.float64), w)
    assert_close(out, want, 1e-5 if dtype == jnp.float32 else 1e-2, "pairs")
    if grad:
        assert dlhs.dtype == lhs.dtype
        assert_close(dlhs, np.einsum("rn,rkn->rk", np.asarray(ct, np.float64), w), 1e-2, "dlhs")


@pytest.mark.parametrize("cfg", [GemvConfig(block_n=32, splits=2, interpret=True),
                                 GemvConfig(block_n=32, splits=1, ahead=0, dequant="pair", interpret=True)])
def test_interpret_pair_dot_two_matrices_one_launch(cfg):
    """Interpreter: gate and up of the same experts in one launch (their N tiles one after the other in the
    grid) are each bitwise the one-matrix call, N off the tile; d lhs sums both matrices' (the reference)."""
    experts, k, n = [3, 0, 3, 1], 64, 48
    lhs, gate, _ = _inputs(11, len(experts), k, n, [0] * 4)
    _, up, _ = _inputs(12, len(experts), k, n, [0] * 4)
    ex = jnp.asarray(experts, jnp.int32)
    assert supported_pairs(lhs, (gate, up), ex, cfg)
    assert not supported_pairs(lhs, (gate, ref.MXFP4(up.codes[:, :, :32], up.scales[:, :, :32])), ex, cfg)
    both = jax.jit(lambda x: pair_dot(x, (gate, up), ex, preferred_element_type=jnp.float32, config=cfg))(lhs)
    for got, m in zip(both, (gate, up)):
        one = jax.jit(lambda x, m=m: pair_dot(x, m, ex, preferred_element_type=jnp.float32, config=cfg))(lhs)
        np.testing.assert_array_equal(got, one)
        want = np.einsum("rk,rkn->rn", np.asarray(lhs.astype(jnp.float32), np.float64), _weights(m, experts))
        assert_close(got, want, 1e-5, "pairs")
    ct = jax.random.normal(jax.random.key(3), (2, len(experts), n), jnp.float32)
    _, vjp = jax.vjp(lambda x: pair_dot(x, (gate, up), ex, preferred_element_type=jnp.float32, config=cfg), lhs)
    dlhs = vjp((ct[0], ct[1]))[0]
    want = sum(np.einsum("rn,rkn->rk", np.asarray(c, np.float64), _weights(m, experts)) for c, m in zip(ct, (gate, up)))
    assert_close(dlhs, want, 1e-2, "dlhs")


def test_gemv_config_and_splits(monkeypatch):
    """Bad configs are refused; splits=0 splits K until ~3 programs an SM, never into empty splits; the
    default converts through E4M3 from compute capability 8.9 on, through fp16 pairs below."""
    for bad in (dict(block_n=96), dict(block_n=16), dict(groups=3), dict(dequant="f16"), dict(dequant="fp8"),
                dict(splits=-1)):
        with pytest.raises(ValueError):
            GemvConfig(**bad)
    assert gemv_splits(4, 2880, 2880, GemvConfig(block_n=256)) == 9  # 9 wanted (4 x 12 x 9 >= 396): 10 steps a split
    assert gemv_splits(4, 2880, 2880, GemvConfig(block_n=256, splits=7)) == 7
    assert gemv_splits(1, 64, 32, GemvConfig(block_n=32)) == 2  # one per K step at most
    assert gemv_splits(4, 2880, 2880, GemvConfig(block_n=64, splits=89)) == 45  # 90 steps: 2 a split
    default = pair_config(4, 2880, 2880)  # pair_dot's default: the matrix-vector kernel (measured faster)
    assert isinstance(default, GemvConfig) and (default.block_n, default.num_warps) == (1024, 4)
    assert default.dequant == "e4m3" and gemv_splits(4, 2880, 2880, default) == 30  # no GPU here: sm_89 assumed
    from tessera.lower.kernels import mxfp4_gemv

    for cc, dequant in (((8, 0), "pair"), ((8, 6), "pair"), ((8, 9), "e4m3"), ((9, 0), "e4m3")):
        monkeypatch.setattr(mxfp4_gemv, "_capability", lambda cc=cc: cc)
        assert pair_config(4, 2880, 2880).dequant == dequant


def test_pair_halves_bits():
    """The jnp pair bits (the interpreter's and the PTX's reference): fp16 halves times 2^14 are E2M1 values."""
    codes = np.arange(256, dtype=np.uint8)
    w = np.asarray(pair_halves(jnp.asarray(codes), ptx=False)).view(np.uint32)
    lo = (w & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64) * 2**14
    hi = (w >> 16).astype(np.uint16).view(np.float16).astype(np.float64) * 2**14
    table = np.asarray(ref.E2M1, np.float64)
    np.testing.assert_array_equal(lo, table[codes & 15])
    np.testing.assert_array_equal(hi, table[codes >> 4])
    np.testing.assert_array_equal(np.signbit(lo), np.signbit(table[codes & 15]))  # -0 stays -0


def test_supported_and_default_config():
    """CPU without the interpreter: not supported; wrong dtypes / shapes: not supported; decode splits K."""
    lhs, rhs, gs = _inputs(0, 8, 64, 32, [8, 0])
    interp = Mxfp4Config(interpret=True)
    assert supported(lhs, rhs, gs, interp)
    assert not supported(lhs, rhs, gs)  # CI has no GPU
    assert not supported(lhs.astype(jnp.float32), rhs, gs, interp)
    assert not supported(lhs, ref.dequantize(rhs), gs, interp)
    assert not supported(lhs[:, :32], rhs, gs, interp)
    decode = default_config(4, 2880, 5760, 32)
    assert (decode.block_m, decode.block_k, decode.splits) == (16, 64, 6)
    assert default_config(32, 2880, 2880, 32).splits == 3  # 8 tokens: most experts hold rows
    assert default_config(8192, 2880, 5760, 32).block_m == 64
    with pytest.raises(ValueError, match="power of two"):
        Mxfp4Config(block_n=96)
    with pytest.raises(ValueError, match="power of two"):
        Mxfp4Config(block_m=3)


def _routing(tokens: int, top_k: int, g: int, seed: int) -> np.ndarray:
    """Group sizes of tokens x top_k distinct experts each (decode routing)."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([rng.choice(g, top_k, replace=False) for _ in range(tokens)])
    return np.bincount(ids, minlength=g).astype(np.int32)


GPU_CASES = [  # tokens, top_k, G, K, N
    (1, 4, 32, 2880, 5760),
    (8, 4, 32, 2880, 2880),
    (64, 4, 128, 2880, 5760),
    (1024, 4, 32, 2880, 5760),  # prefill-sized
    (3, 2, 8, 512, 200),  # N off the tile
]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top_k,g,k,n", GPU_CASES)
def test_gpu_matches_reference(tokens, top_k, g, k, n):
    """On a GPU: decode and prefill routing against dequantise + ragged_dot, plus a tail of unrouted rows."""
    sizes = _routing(tokens, top_k, g, seed=tokens + g)
    m = tokens * top_k + 5  # 5 rows past sum(sizes)
    lhs, rhs, gs = _inputs(tokens, m, k, n, sizes)
    assert supported(lhs, rhs, gs)
    out = jax.jit(ragged_dot)(lhs, rhs, gs)
    assert_close(out, _want(lhs, rhs, gs), 1e-2, "out")
    assert float(jnp.abs(out[-5:].astype(jnp.float32)).max()) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("r,g,n", [(4, 32, 5760), (5, 128, 2880), (1, 32, 2880), (8, 32, 200)])
def test_gpu_pair_dot_default_matches_reference(r, g, n):
    """On a GPU: pair_dot's default (the matrix-vector kernel) at decode shapes, unsorted experts with a
    repeat, against the reference's pair_dot; bf16 and fp32 out."""
    rng = np.random.default_rng(r * g + n)
    lhs, rhs, _ = _inputs(r + g, r, 2880, n, [0] * g)
    experts = rng.integers(0, g, r).astype(np.int32)
    experts[-1] = experts[0]
    ex = jnp.asarray(experts)
    assert supported_pairs(lhs, rhs, ex) and isinstance(pair_config(r, 2880, n), GemvConfig)
    want = ref.pair_dot(lhs.astype(jnp.float32), rhs, ex, preferred_element_type=jnp.float32)
    got = jax.jit(lambda a, b, e: pair_dot(a, b, e, preferred_element_type=jnp.float32))(lhs, rhs, ex)
    assert_close(got, want, 1e-5, "fp32 out")
    assert_close(jax.jit(pair_dot)(lhs, rhs, ex), want, 1e-2, "bf16 out")


@pytest.mark.gpu
@pytest.mark.parametrize("r,n", [(4, 2880), (1, 200)])
def test_gpu_pair_dot_two_matrices_match_reference(r, n):
    """On a GPU: gate and up in one launch of the matrix-vector kernel, each against the reference's pair_dot."""
    lhs, gate, _ = _inputs(r + n, r, 2880, n, [0] * 32)
    _, up, _ = _inputs(r + n + 1, r, 2880, n, [0] * 32)
    ex = jnp.asarray(np.random.default_rng(n).integers(0, 32, r).astype(np.int32))
    assert supported_pairs(lhs, (gate, up), ex)
    got = jax.jit(lambda a, e: pair_dot(a, (gate, up), e, preferred_element_type=jnp.float32))(lhs, ex)
    for out, m in zip(got, (gate, up)):
        assert_close(out, ref.pair_dot(lhs.astype(jnp.float32), m, ex, preferred_element_type=jnp.float32), 1e-5,
                     "fp32 out")


@pytest.mark.gpu
def test_gpu_select_picks_the_kernel():
    """kernels: auto on a GPU: the ragged_dot primitive runs the kernel for packed experts, reports it, fp32 out."""
    from tessera.lower import table
    from tessera.lower.context import LowerCtx

    sizes = _routing(8, 4, 32, seed=1)
    lhs, rhs, gs = _inputs(1, 32, 2880, 5760, sizes)
    ctx = LowerCtx(kernels="auto", backend="gpu", report={})
    out = jax.jit(lambda a, b, c: table.bound(ctx, "ragged_dot", "experts")(a, b, c, preferred_element_type=jnp.float32))(
        lhs, rhs, gs)
    assert ctx.report["experts"].startswith("mxfp4_ragged_dot")
    assert out.dtype == jnp.float32
    assert_close(out, _want(lhs, rhs, gs), 1e-5, "out")


def _reference_bits(nibble, scales) -> np.ndarray:
    """uint16 bf16 bits of E2M1 codes `nibble` times 2^(scales - 127), computed in float64 (no flushing)."""
    with np.errstate(over="ignore"):  # scales past 2^127 / 6 give inf
        exact = np.ldexp(np.asarray(ref.E2M1, np.float64)[nibble], scales.astype(np.int64) - 127)
        return np.asarray(exact, np.float32).astype(jnp.bfloat16).view(np.uint16)


def _all_codes_and_scales(dtype):
    """Every code byte x every scale byte 1..254, as two flat arrays."""
    return np.repeat(np.arange(256, dtype=dtype), 254), np.tile(np.arange(1, 255, dtype=dtype), 256)


def test_interpreter_dequantize_tile_is_bitwise_the_reference():
    """The interpreter's conversion: every code x scale 2..254 exact; under the scale 1 (2^-126) only the
    codes +-0.5, whose 2^-127 XLA:CPU flushes, give zero."""
    from tessera.lower.kernels.mxfp4_matmul import dequantize_tile

    codes, scales = _all_codes_and_scales(np.uint8)
    lo, hi = dequantize_tile(jnp.asarray(codes), jnp.asarray(scales), interpret=True)
    for got, nibble in ((lo, codes & 15), (hi, codes >> 4)):
        got, want = np.asarray(got).view(np.uint16), _reference_bits(nibble, scales)
        flushed = (scales == 1) & ((nibble & 7) == 1)
        np.testing.assert_array_equal(got[~flushed], want[~flushed])
        assert set(got[flushed].tolist()) <= {0x0000, 0x8000}


def _run_ptx(asm: str, regs: dict) -> dict:
    """Runs the instructions `_DEQUANT_PTX`, `_PAIR_PTX`, `_E4M3_PTX` and `_FMA_PTX` use (mov, prmt, shl,
    shr, and, or on .b32; fma.rn.bf16x2, fma.rn.f32; bfe.u32, mul.lo.u32; cvt.rn.f16x2.e4m3x2, cvt.f32.f16; mov.b32 {a, b}
    unpacking) on uint32 numpy arrays, one lane per instance; `regs` maps "$i" to inputs; returns every
    register."""
    regs = dict(regs)

    def val(tok):
        return regs[tok] if tok in regs else np.uint32(int(tok, 0))

    def halves(x):  # a bf16x2 register -> its two halves as float64
        return [np.asarray((x >> sh) & 0xFFFF, np.uint16).view(jnp.bfloat16).astype(np.float64) for sh in (0, 16)]

    for line in asm.strip("{}\n").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):  # unpack: {lo16, hi16}, src
            dests, src = args.split("}")
            lo16, hi16 = (t.strip("{ ") for t in dests.split(","))
            word = regs[src.strip(", ")]
            regs[lo16], regs[hi16] = word & 0xFFFF, word >> 16
            continue
        d, *src = [a.strip() for a in args.split(",")]
        x = [val(a) for a in src]
        if op == "mov.b32":
            out = x[0]
        elif op == "prmt.b32":  # default mode: byte i of d is byte sel_i of {b, a}
            sel = int(src[2], 0)
            out = np.uint32(0)
            for i in range(4):
                j = (sel >> 4 * i) & 0xF
                assert j < 8, "prmt sign-replicate mode is not emulated"
                byte = (x[0] >> 8 * j) & 0xFF if j < 4 else (x[1] >> 8 * (j - 4)) & 0xFF
                out = out | (byte << 8 * i)
        elif op in ("shl.b32", "shr.b32"):
            out = x[0] << x[1] if op == "shl.b32" else x[0] >> x[1]
        elif op == "cvt.rn.f16x2.e4m3x2":  # low byte -> low half, high byte -> high half (exact)
            f16 = lambda b: (np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16)
                             .view(np.uint16).astype(np.uint32))
            out = f16(x[0] & 0xFF) | f16(x[0] >> 8) << 16
        elif op == "cvt.f32.f16":
            out = np.asarray(x[0], np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
        elif op == "bfe.u32":  # bit field extract: x[1] bits from bit x[0]... as (src, start, length)
            out = (x[0] >> x[1]) & ((np.uint32(1) << x[2]) - np.uint32(1))
        elif op == "mul.lo.u32":
            out = np.asarray((x[0].astype(np.uint64) * np.uint64(x[1])) & np.uint64(0xFFFFFFFF), np.uint32)
        elif op in ("and.b32", "or.b32"):
            out = x[0] & x[1] if op == "and.b32" else x[0] | x[1]
        elif op == "fma.rn.f32":  # exact in float64 where the test keeps a * b + c exact; one rounding
            f = lambda v: np.asarray(v, np.uint32).view(np.float32).astype(np.float64)
            out = (f(x[0]) * f(x[1]) + f(x[2])).astype(np.float32).view(np.uint32)
        elif op == "fma.rn.bf16x2":  # every product here is exact in float64; one rounding to bf16
            with np.errstate(over="ignore"):  # overflow to inf, as the hardware rounds it
                lo, hi = (np.asarray(a * b + c).astype(jnp.bfloat16).view(np.uint16).astype(np.uint32)
                          for a, b, c in zip(*(halves(v) for v in x)))
            out = lo | (hi << 16)
        else:
            raise AssertionError(f"instruction {op} is not emulated")
        regs[d] = np.asarray(out, np.uint32)
    return regs


def test_dequant_ptx_is_bitwise_the_reference_on_an_emulator():
    """The inline PTX itself, run by a small emulator of its instructions: every code byte x every
    scale byte 1..254 gives the reference's bf16 bits (the GPU test below runs it on the hardware)."""
    from tessera.lower.kernels.mxfp4_matmul import _DEQUANT_HI, _DEQUANT_LO

    codes, scales = _all_codes_and_scales(np.uint32)
    pack = lambda b: b[0::4] | b[1::4] << 8 | b[2::4] << 16 | b[3::4] << 24  # four bytes a register
    for asm, nibble in ((_DEQUANT_LO, codes & 15), (_DEQUANT_HI, codes >> 4)):
        out = _run_ptx(asm, {"$2": pack(codes), "$3": pack(scales)})
        got = np.stack([out["$0"] & 0xFFFF, out["$0"] >> 16, out["$1"] & 0xFFFF, out["$1"] >> 16], axis=1)
        np.testing.assert_array_equal(got.reshape(-1).astype(np.uint16), _reference_bits(nibble, scales))


def _every_byte_in_every_position(seed: int):
    """(bytes [4 positions, 256] as uint32, the 256 registers packing them): every byte value once in each of a
    register's four positions, the other positions random permutations."""
    rng = np.random.default_rng(seed)
    b = np.stack([np.arange(256, dtype=np.uint32)] + [rng.permutation(256).astype(np.uint32) for _ in range(3)])
    for pos in range(4):
        rolled = np.roll(b, pos, axis=0)
        yield rolled, rolled[0] | rolled[1] << 8 | rolled[2] << 16 | rolled[3] << 24


def test_pair_ptx_is_bitwise_the_jnp_bits_on_an_emulator():
    """`_PAIR_PTX` (four code bytes a register -> four fp16 pairs) gives `pair_halves`'s jnp bits for every
    byte in every one of the four positions."""
    from tessera.lower.kernels.mxfp4_gemv import _PAIR_PTX

    for rolled, word in _every_byte_in_every_position(3):
        out = _run_ptx(_PAIR_PTX, {"$4": word})
        for i in range(4):
            want = np.asarray(pair_halves(jnp.asarray(rolled[i].astype(np.uint8)), ptx=False)).view(np.uint32)
            np.testing.assert_array_equal(out[f"${i}"], want)


def test_e4m3_ptx_is_bitwise_the_reference_on_an_emulator():
    """`_E4M3_LO` / `_E4M3_HI` (four code bytes -> four fp32 values of one nibble, times 2^-6): the E2M1
    values exactly, signed zeros and the code 0.5 included, for every byte in every position; the jnp
    route the interpreter takes gives the same bits."""
    from tessera.lower.kernels.mxfp4_gemv import _E4M3_HI, _E4M3_LO, E4M3_SHIFT, nibbles_e4m3

    table = np.asarray(ref.E2M1, np.float32) / np.float32(E4M3_SHIFT)
    for rolled, word in _every_byte_in_every_position(4):
        jnp_lo, jnp_hi = nibbles_e4m3(jnp.asarray(rolled.astype(np.uint8)), ptx=False)
        for asm, nib, via_jnp in ((_E4M3_LO, rolled & 15, jnp_lo), (_E4M3_HI, rolled >> 4, jnp_hi)):
            out = _run_ptx(asm, {"$4": word})
            want = table[nib].view(np.uint32)  # [4 positions, 256]
            got = np.stack([out[f"${i}"] for i in range(4)])
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(np.asarray(via_jnp).view(np.uint32), want)


def test_fma_ptx_rounds_once_on_an_emulator():
    """`_FMA_PTX` is a * b + c rounded once: with c = -fl(a * b), it returns the product's rounding error
    (exact in fp32), where a multiply and an add (the interpreter's route) return zero."""
    from tessera.lower.kernels.mxfp4_gemv import _FMA_PTX, fma

    rng = np.random.default_rng(5)
    a, b = (rng.standard_normal(256).astype(np.float32) for _ in range(2))
    c = -(a * b)  # fl(a * b) in fp32
    error = (a.astype(np.float64) * b + c).astype(np.float32)  # exact: the product's rounding error
    assert np.count_nonzero(error) > 200
    out = _run_ptx(_FMA_PTX, {"$1": a.view(np.uint32), "$2": b.view(np.uint32), "$3": c.view(np.uint32)})
    np.testing.assert_array_equal(out["$0"].view(np.float32), error)
    np.testing.assert_array_equal(np.asarray(fma(jnp.asarray(a), jnp.asarray(b), jnp.asarray(c), ptx=False)), 0)


@pytest.mark.gpu
def test_gpu_dequantize_is_bitwise_the_reference():
    """The inline-PTX conversion on every code byte x every scale byte 1..254: the reference's bf16 bits
    (signed zeros, the subnormal code 0.5, and the scales that overflow to inf included)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    from tessera.lower.kernels.mxfp4_matmul import dequantize_tile

    codes = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None], (256, 256))
    scales = np.broadcast_to((1 + np.arange(256) % 254).astype(np.uint8)[None, :], (256, 256))

    def body(c_ref, s_ref, lo_ref, hi_ref):
        lo_ref[...], hi_ref[...] = dequantize_tile(c_ref[...], s_ref[...])
    out = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    lo, hi = pl.pallas_call(body, out_shape=(out, out),
                            compiler_params=pltriton.CompilerParams(num_warps=4))(
        jnp.asarray(codes), jnp.asarray(scales))
    for got, nibble in ((lo, codes & 15), (hi, codes >> 4)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), _reference_bits(nibble, scales))
