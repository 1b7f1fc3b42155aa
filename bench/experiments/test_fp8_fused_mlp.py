"""The fused gate/up/SwiGLU custom VJP (bench/experiments/fp8_fused_mlp.py, the kernel in the Pallas interpreter)
trains the tiny Llama as the built lowering does under the same scaling (train_variants' "history only")."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.experiments import fp8_fused_mlp
from bench.experiments.lowering_variants import history_only, patched
from tessera.lower import program
from tessera.lower.program import compile_experiment
from tessera.lower.reference import fp8
from tessera.run.optim import build_optimizer
from tessera.spec import load_experiment

ROOT = Path(__file__).resolve().parents[2]
POLICY = "fp8_e4m3 @scale(delayed(4)) @accum(fp32)"


def _train(patches, steps=4):
    exp = load_experiment(ROOT / "specs/llama_tiny.yaml", {"numerics.default": POLICY, "task.batch": 4,
                                                          "task.seq_len": 16, "parallel.deterministic": False,
                                                          "task.optimizer.lr": 1e-2, "kernels": "reference"})
    seq = jnp.asarray(np.random.default_rng(0).integers(1, 256, (4, 16)), jnp.int32)
    batch = {"tokens": seq, "targets": jnp.roll(seq, -1, 1), "mask": jnp.ones((4, 16), jnp.float32)}
    with patched(patches):
        program._PROGRAMS.clear()
        prog = compile_experiment(exp, optimizer=build_optimizer(exp))
        state = prog.init_train_state(prog.init(0))
        kernels = str(jax.make_jaxpr(prog.train_step_fn())(state, batch)).count("pallas_call")
        # every gradient row seeded with a range (1e-3) its gradients lie under, so step 1's gradients do not
        # underflow e5m2 at scale 1 (history only: no fallback to their amax) and flip codes on rounding noise
        history = {k: v.at[..., 2, 0].set(1e-3) for k, v in state.opt_state.history.items()}
        state = state._replace(opt_state=state.opt_state._replace(history=history))
        losses = []
        for _ in range(steps):
            state, m = prog.train_step(state, batch)
            losses.append(float(m["loss"]))
    program._PROGRAMS.clear()
    return np.array(losses), state, kernels


def test_the_fused_product_is_the_built_products_bit_for_bit():
    """gate and up of one MLP (held weights, delayed histories with a gradient range) and their VJP: the fused
    custom VJP gives the built products' h, dx, d gate and d up exactly."""
    from tessera.lower.reference import activations

    k = jax.random.split(jax.random.key(0), 4)
    b, s, e, f = 2, 32, 128, 256
    x = jax.random.normal(k[0], (b, s, e), jnp.bfloat16)
    wg, wu = ((0.05 * jax.random.normal(kk, (e, f))).astype(jnp.bfloat16) for kk in k[1:3])
    cot = (1e-4 * jax.random.normal(k[3], (b, s, f))).astype(jnp.bfloat16)
    rows = jnp.zeros((3, 4), jnp.float32).at[2, 0].set(1e-3)
    hg, hu = (rows.at[1, 0].set(jnp.max(jnp.abs(w.astype(jnp.float32)))) for w in (wg, wu))
    with patched([(fp8, "quantize_delayed", history_only)]):
        held_g, held_u = fp8.hold(wg, jnp.bfloat16, hg, lead=1), fp8.hold(wu, jnp.bfloat16, hu, lead=1)

        def built(x, wg, wu):
            g, u = (fp8.einsum("bse,ef->bsf", x, w, accum=jnp.float32, preferred_element_type=jnp.bfloat16,
                               scaling="delayed(4)", history=h, held=held)
                    for w, h, held in ((wg, hg, held_g), (wu, hu, held_u)))
            return activations.swiglu(g, u)

        def fused(x, wg, wu):
            aw = jnp.stack([held_g[2], held_u[2]])
            return fp8_fused_mlp._gate_up(x, wg, wu, held_g, held_u, hg, hu, aw, jnp.dtype(jnp.float32),
                                          jnp.dtype(jnp.bfloat16))

        got, want = ((h, *vjp(cot)) for h, vjp in (jax.vjp(fn, x, wg, wu) for fn in (fused, built)))
        for a, w in zip(got, want):
            assert a.dtype == w.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(w, np.float32))


def test_the_fused_mlp_trains_as_the_built_one():
    """The tiny Llama's step with the fused MLP: the losses of four steps within 1e-3 of the built lowering's (the
    same scaling), and gate's amax history takes every row's amax."""
    base, _, none = _train([(fp8, "quantize_delayed", history_only)])
    fused, s1, kernels = _train([(fp8, "quantize_delayed", history_only), *fp8_fused_mlp.PATCHES])
    assert none == 0 and kernels >= 1  # the layers' MLP took the fused path (its kernel in the step)
    np.testing.assert_allclose(fused, base, rtol=1e-3)
    (h,) = (v for k, v in s1.opt_state.history.items() if "mlp/gate" in k)
    assert (np.asarray(h)[..., :, 0] > 0).all()  # every row took each step's amax: input, weight, gradient
