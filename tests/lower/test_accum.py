"""`@accum(bf16)` / `@accum(fp16)` are the arithmetic done (tessera/lower/reference/accum.py), not a label.

The operands are small integers, so every product and every 16-product block sum is exact in fp32 whatever
order XLA sums in: the numpy models below are then exact, and the comparisons are equalities. A narrow
accumulator rounds its running sum (beyond 256 for bf16, 2048 for fp16), so it differs from fp32
accumulation rounded once, which is what `@accum(fp32)` computes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tessera.ir import parse_graph, verify
from tessera.lower import table
from tessera.lower.context import LowerCtx
from tessera.lower.interpret import eval_region
from tessera.lower.reference import accum
from tessera.lower.reference.attention import attention

NP = {jnp.bfloat16: ml_dtypes.bfloat16, jnp.float16: np.float16}


def _ints(shape, seed, lo=-8, hi=9):
    return np.random.default_rng(seed).integers(lo, hi, shape).astype(np.float32)


def _narrow_model(a2, b2, dt):
    """a2 [M, K] @ b2 [K, N] accumulating in dt: blocks of 16 summed exactly (float64), rounded to dt, added
    in order in dt (numpy's float16 / ml_dtypes' bfloat16: each add rounds once)."""
    t = NP[dt]
    acc = None
    for s in range(0, a2.shape[1], accum.ACCUM_BLOCK):
        part = (a2[:, s:s + 16].astype(np.float64) @ b2[s:s + 16].astype(np.float64)).astype(t)
        acc = part if acc is None else (acc.astype(np.float32) + part.astype(np.float32)).astype(t)
    return acc.astype(np.float32)


def _wide_model(a2, b2, dt):
    """fp32 accumulation (exact here), rounded once to dt."""
    return (a2.astype(np.float64) @ b2.astype(np.float64)).astype(NP[dt]).astype(np.float32)


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16])
def test_a_narrow_accumulator_is_the_blocked_arithmetic_and_differs_from_fp32(dt):
    # K = 2 x 100 contracted over two dims (attention's output projection `bshd,hde->bse`), 13 blocks, the last short
    hi = 40 if dt == jnp.float16 else 9  # fp16 rounds integers past 2048: larger products
    x, w = _ints((2, 3, 2, 100), 0, -hi, hi), _ints((2, 100, 5), 1, -hi, hi)
    got = np.asarray(accum.einsum("bshd,hde->bse", jnp.asarray(x, dt), jnp.asarray(w, dt), accum=dt), np.float32)
    wide = np.asarray(accum.einsum("bshd,hde->bse", jnp.asarray(x, dt), jnp.asarray(w, dt), accum=jnp.float32,
                                   preferred_element_type=dt), np.float32)
    a2, b2 = x.reshape(6, 200), w.reshape(200, 5)
    np.testing.assert_array_equal(got.reshape(6, 5), _narrow_model(a2, b2, dt))
    np.testing.assert_array_equal(wide.reshape(6, 5), _wide_model(a2, b2, dt))
    assert (got != wide).mean() > 0.2


def test_gradients_accumulate_in_the_narrow_type_too():
    a, b, g = _ints((40, 48), 2), _ints((48, 40), 3), _ints((40, 40), 4, -30, 31)  # contractions 40 or 48 long
    dt = jnp.bfloat16

    def grads(contract):
        f = lambda a, b: jnp.vdot(contract(a, b).astype(jnp.float32), g)  # noqa: E731
        return [np.asarray(d, np.float32) for d in jax.grad(f, (0, 1))(jnp.asarray(a, dt), jnp.asarray(b, dt))]

    da, db = grads(lambda a, b: accum.einsum("mk,kn->mn", a, b, accum=dt))
    np.testing.assert_array_equal(da, _narrow_model(g, b.T, dt))  # dA = G Bᵀ, accumulated over n
    np.testing.assert_array_equal(db, _narrow_model(a.T, g, dt))  # dB = Aᵀ G, accumulated over m
    wa, wb = grads(lambda a, b: jnp.einsum("mk,kn->mn", a, b, preferred_element_type=dt))  # XLA's own: fp32
    assert (da != wa).mean() > 0.2 and (db != wb).mean() > 0.2


def test_the_grouped_product_accumulates_per_group():
    lhs, rhs = _ints((10, 64), 5), _ints((3, 64, 4), 6)
    sizes = np.array([4, 0, 5], np.int32)  # the last row belongs to no group: zeros
    dt = jnp.bfloat16
    got = np.asarray(accum.ragged_dot(jnp.asarray(lhs, dt), jnp.asarray(rhs, dt), jnp.asarray(sizes), accum=dt),
                     np.float32)
    want = np.zeros((10, 4), np.float32)
    want[:4], want[4:9] = _narrow_model(lhs[:4], rhs[0], dt), _narrow_model(lhs[4:9], rhs[2], dt)
    np.testing.assert_array_equal(got, want)


def _graph(op: str, result: str) -> str:
    return f"""graph g {{
  input %x : bf16[batch=3, embed=80]
  input %w : bf16[embed=80, mlp=6]
  %0 = {op} : {result}
  return %0
}}"""


@pytest.mark.parametrize("op, result", [("dot(%x, %w) {over = [embed]}", "bf16[batch=3, mlp=6]"),
                                        ("sum(%x) {over = [embed]}", "bf16[batch=3]")])
def test_the_ops_lower_with_the_context_accumulator(op, result):
    x, w = _ints((3, 80), 7, -100, 101), _ints((80, 6), 8)  # integers bf16 holds exactly (up to 256)
    graph = verify(parse_graph(_graph(op, result)))
    args = [jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)]
    run = lambda ctx: np.asarray(eval_region(graph.body, args, {}, ctx)[0][0], np.float32)  # noqa: E731
    b = w if op.startswith("dot") else np.ones((80, 1), np.float32)
    narrow, wide = run(LowerCtx(accum_dtype=jnp.bfloat16)), run(LowerCtx())
    np.testing.assert_array_equal(narrow.reshape(3, -1), _narrow_model(x, b, jnp.bfloat16))
    np.testing.assert_array_equal(wide.reshape(3, -1), _wide_model(x, b, jnp.bfloat16))
    assert (narrow != wide).any()


def test_attention_reference_accumulates_the_scores_narrow():
    # q·k over head_dim 64 (4 blocks) of integers: exact blocks, scores past 256 rounded by the bf16 accumulator;
    # v = identity rows makes the output the probabilities themselves, which the rounded scores move by percents
    q, k = _ints((1, 1, 1, 64), 9), _ints((1, 48, 1, 64), 10)
    v = jnp.asarray(np.eye(48, 64, dtype=np.float32)[None, :, None, :], jnp.bfloat16)
    dt, scale = jnp.bfloat16, 1 / 64
    out = lambda acc: attention(jnp.asarray(q, dt), jnp.asarray(k, dt), v, causal=False, scale=scale,  # noqa: E731
                                accum=acc)
    narrow, wide = np.asarray(out(dt), np.float32)[0, 0, 0, :48], np.asarray(out(None), np.float32)[0, 0, 0, :48]

    def probs(scores):
        p = np.exp(scores - scores.max())
        return (p / p.sum()).astype(ml_dtypes.bfloat16).astype(np.float32)

    exact = (q[0, :, 0] @ k[0, :, 0].T)[0] * scale
    np.testing.assert_allclose(narrow, probs(_narrow_model(q[0, :, 0], k[0, :, 0].T, dt)[0] * scale), rtol=1e-2)
    np.testing.assert_allclose(wide, probs(exact), rtol=1e-2)
    assert not np.allclose(narrow, wide, rtol=3e-2)


def test_kernels_step_aside_for_a_narrow_accumulator():
    ctx = LowerCtx(kernels="auto", backend="gpu", accum_dtype=jnp.bfloat16)
    choice, fn = table.choose(ctx, "attention", None, None, None, sinks=None, causal=True, window=None, scale=None)
    assert choice == "reference (jax.numpy): accumulates in bfloat16 (@accum); the kernels accumulate in fp32"
    assert fn.keywords == {"accum": jnp.bfloat16}


def test_a_narrow_accumulator_is_refused_for_complex_products():
    from tessera.ir.check import _narrow_accum_training
    from tessera.spec import load_experiment
    from tests.lower.shard.make_snapshots import ROOT

    graph = verify(parse_graph("""graph g {
  input %x : f32[batch, seq=16, embed=4]
  %0 = rfft(%x) {over = [seq], norm = "backward", to = [freq]} : c64[batch, freq=9, embed=4]
  return %0
}"""))
    spec = ROOT / "specs" / "llama_tiny.yaml"
    (problem,) = _narrow_accum_training(load_experiment(spec, overrides={"numerics.default": "bf16 @accum(bf16)"}),
                                        graph, "bf16")
    assert problem.key == "numerics.default" and problem.span is not None
    assert "`@accum(bf16)` is not honoured by complex products and Fourier transforms, which accumulate in their own" \
        in problem.message
    assert _narrow_accum_training(load_experiment(spec), graph, "fp32") == []


def test_the_program_runs_the_policys_accumulator():
    from tessera.lower.program import compile_experiment
    from tessera.spec import load_experiment
    from tests.lower.shard.make_snapshots import ROOT

    args = {"model.args.layers": 1, "model.args.d_model": 64, "model.args.d_ff": 128, "model.args.vocab": 64}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), jnp.int32)

    def logits(policy):
        exp = load_experiment(str(ROOT / "specs" / "llama_tiny.yaml"), overrides={"numerics.default": policy, **args})
        prog = compile_experiment(exp)
        return prog, np.asarray(prog.forward(prog.init(0), tokens), np.float32)

    narrow, y16 = logits("bf16 @accum(bf16)")
    wide, y32 = logits("bf16 @accum(fp32)")
    assert narrow.lower_ctx().accum_dtype == jnp.bfloat16 and wide.lower_ctx().accum_dtype == jnp.float32
    assert (y16 != y32).mean() > 0.05  # bf16 accumulation moves the logits
    np.testing.assert_allclose(y16, y32, atol=0.1)  # by rounding, not by breaking them
