"""`parallel.remat: none` keeps what the plan counts for a layer: every op's results and products, not the values an
op computes inside itself (tessera/lower/interpret.py KEEP_RESULTS)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tessera.ir import cost
from tessera.ir.check import check_experiment
from tessera.lower.program import compile_experiment
from tessera.spec import load_experiment

ROOT = Path(__file__).resolve().parents[2]
B, S = 4, 32


def _layer_residuals(exp) -> list:
    """The values the forward layers of the loss's gradient keep for the backward: the unrolled layers' forward calls'
    outputs past the carry (the layer's one output, x), every layer's."""
    prog = compile_experiment(exp)
    params = jax.eval_shape(lambda: prog.init(0))
    batch = {"tokens": jax.ShapeDtypeStruct((B, S), jnp.int32), "targets": jax.ShapeDtypeStruct((B, S), jnp.int32),
             "mask": jax.ShapeDtypeStruct((B, S), jnp.float32)}
    jaxpr = jax.make_jaxpr(jax.value_and_grad(prog.loss_fn()))(params, batch).jaxpr
    layers = [e for e in jaxpr.eqns if e.params.get("name") == "layer"][:exp.model.args["layers"]]  # the forward's
    return [v.aval for e in layers for v in e.outvars[1:]]


def test_remat_none_keeps_what_the_plan_counts_for_a_layer():
    """The tiny Llama's layers under remat none keep 1.18 MB for the backward besides their inputs (1.31 MB with them,
    as the layers' scan stacked them) against the plan's 1.71 MB (each op's results and products: the adds' results
    and the projections' outputs, which no backward reads, are counted and not kept); without a policy JAX kept
    2.75 MB (every fp32 internal, the norms' statistics, the reference attention's probabilities; 3.53 MB before
    SwiGLU's VJP kept only its inputs).
    Not above the plan, and not so far below it that the layers keep nothing and recompute their products."""
    exp = load_experiment(ROOT / "specs/llama_tiny.yaml", {"parallel.deterministic": False, "parallel.remat": "none",
                                                          "task.batch": B, "task.seq_len": S, "kernels": "reference"})
    kept = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in _layer_residuals(exp))
    planned = cost.activation_bytes(check_experiment(exp), {"batch": B, "seq": S}, "none")
    assert 0.5 * planned["per_layer"] * planned["layers"] < kept <= planned["per_layer"] * planned["layers"]
