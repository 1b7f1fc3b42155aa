"""Context parallelism over `sp` in fast mode: training agrees with one device within 1e-5 relative, the
attention lowering under sp matches the whole-sequence attention, generation under sp gives the same tokens.

The sharded runs happen in 8-device subprocesses (conftest); `python -m tests.lower.shard.test_context_parallel`
runs the attention cases (the parent sets XLA_FLAGS first).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.lower.shard.conftest import DEVICES, ROOT, assert_trained_close, finish_jobs, start_jobs
from tests.cpu_env import cpu_env

pytestmark = pytest.mark.slow  # compiles on 8 devices: scheduled first (tests/conftest.py)

GPT_OSS, LLAMA = "specs/gpt_oss_tiny.yaml", "specs/llama_tiny.yaml"
# seq 16 against GPT-OSS's window of 4 (the worker's small model): on sp=2 a block holds 8 tokens, on sp=4 it
# holds 4, so the windowed layers read keys across block boundaries either way; 2 layers (one windowed, one
# not) compile faster than the worker's 4
SEQ = {"task.seq_len": 16, "parallel.deterministic": False, "model.args.layers": 2}
MESHES = {
    "sp=2,tp=2,dp=2": {"mesh.sp": 2, "mesh.tp": 2, "mesh.dp": 2, "parallel.sequence_parallel": True},
    "sp=4,dp=2": {"mesh.sp": 4, "mesh.dp": 2},
    "sp=2,dp=4": {"mesh.sp": 2, "mesh.dp": 4},
}
TRAIN = {"gpt_oss": (GPT_OSS, ("sp=2,tp=2,dp=2", "sp=4,dp=2")), "llama": (LLAMA, ("sp=2,dp=4",))}
WINDOWS = (3, 8, 13, None)  # smaller than, equal to and larger than a block of 8 tokens; none


def _train_jobs(spec: str, meshes) -> list[dict]:
    return [{"kind": "train", "spec": spec, "steps": 2, "name": name, "overrides": {**SEQ, **MESHES.get(name, {})}}
            for name in ("1 device",) + tuple(meshes)]


def _gen_jobs() -> list[dict]:
    return [{"kind": "generate", "spec": GPT_OSS, "steps": 6, "name": name,
             "overrides": {**SEQ, **MESHES.get(name, {})}} for name in ("1 device", "sp=2,dp=4")]


def _start_attention_cases() -> subprocess.Popen:
    env = cpu_env(DEVICES)
    return subprocess.Popen([sys.executable, "-m", "tests.lower.shard.test_context_parallel"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def results():
    """{(model, mesh) or ("generate", mesh) or "attention": result}, from three subprocesses side by side."""
    plans = {"gpt_oss": _train_jobs(GPT_OSS, TRAIN["gpt_oss"][1]),
             "llama": _train_jobs(LLAMA, TRAIN["llama"][1]) + _gen_jobs()}
    procs = {model: start_jobs(jobs) for model, jobs in plans.items()}
    attention = _start_attention_cases()
    out = {}
    for model, proc in procs.items():
        for job, res in zip(plans[model], finish_jobs(proc)):
            key = "generate" if job["kind"] == "generate" else "llama" if job["spec"] == LLAMA else "gpt_oss"
            out[(key, job["name"])] = res
    stdout, stderr = attention.communicate(timeout=900)
    assert attention.returncode == 0 and "RESULT " in stdout, stderr[-4000:]
    out["attention"] = json.loads(stdout.split("RESULT ", 1)[1])
    return out


CASES = [(model, mesh) for model, (_, meshes) in TRAIN.items() for mesh in meshes]


@pytest.mark.parametrize("model,mesh", CASES)
def test_context_parallel_training_agrees_with_one_device(results, model, mesh):
    ref, got = results[(model, "1 device")], results[(model, mesh)]
    assert got["deterministic"] is False
    assert "all_gather(k, v over sp)" in got["collectives"]
    assert any(c.startswith("psum(grads over") and "sp" in c for c in got["collectives"])
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert got["losses"][1] != got["losses"][0]
    assert_trained_close(got["params"], ref["params"])


def test_generation_under_sp_matches_one_device(results):
    ref, got = results[("generate", "1 device")], results[("generate", "sp=2,dp=4")]
    assert np.asarray(got["tokens"]).shape == (4, 11)
    assert got["tokens"] == ref["tokens"]


@pytest.mark.parametrize("case", [f"window={w}" for w in WINDOWS] + ["bidirectional"])
def test_attention_under_sp_matches_the_whole_sequence(results, case):
    got = results["attention"][case]
    assert got["shape"] == [2, 32, 32]
    assert got["max_err"] <= 2e-6 * got["max_ref"], got
    assert got["grad_err"] <= 2e-6 * got["grad_ref"], got
    if case.startswith("window=") and case != "window=None":
        assert got["window_bites"]  # the window changes the answer: the case tests the mask, not just causality


def test_offset_queries_fall_back_to_the_reference_attention():
    import jax
    import jax.numpy as jnp

    from tessera.lower import table
    from tessera.lower.context import LowerCtx
    from tessera.lower.reference.attention import attention

    q, k, v = (jax.random.normal(jax.random.key(i), (1, s, 4, 64), jnp.float32) for i, s in enumerate((4, 8, 8)))
    ctx = LowerCtx(kernels="auto", backend="gpu", report={})
    core = dict(sinks=None, causal=True, window=3, scale=None)
    out = jax.jit(lambda q, k, v, off: table.dispatch(ctx, "attention", "a", q, k, v, q_offset=off, **core))(q, k, v, 4)
    assert ctx.report["a"] == "reference (jax.numpy): queries at a per-device offset (context parallel)"
    np.testing.assert_allclose(out, attention(q, k, v, q_offset=4, **core), rtol=1e-6, atol=1e-6)
    assert not np.allclose(out, attention(q, k, v, q_offset=0, **core), atol=1e-3)  # the offset matters


def test_shard_pass_splits_activation_seq_over_sp_and_the_plan_checks_the_length():
    import jax

    from tessera.diagnostics import TesseraError
    from tessera.ir.passes import PassContext, run_pass
    from tessera.lower.options import CompileOptions
    from tessera.lower.program import program_graph
    from tessera.lower.shard.step import make_plan
    from tessera.spec import load_experiment

    over = {"mesh.sp": 2, "mesh.tp": 2, "mesh.dp": 2, "parallel.sequence_parallel": True, **SEQ}
    exp = load_experiment(ROOT / GPT_OSS, overrides=over)
    text = str(run_pass("shard", program_graph(exp), PassContext.of(exp)))
    assert "input %tokens : i32[batch, seq] | [dp, sp]" in text  # tokens whole over tp, as the lowering takes them
    attention = next(line for line in text.splitlines() if "= attention(" in line)
    assert attention.endswith(": f32[batch, seq, embed=128] | [dp, sp*tp, -]")  # between blocks: seq over sp×tp
    unembed = next(line for line in text.splitlines() if "= unembed(" in line)
    assert unembed.endswith(": f32[batch, seq, vocab=256] | [dp, sp, tp]")  # logits: seq over sp, vocab over tp
    bad = load_experiment(ROOT / GPT_OSS, overrides={**over, "task.seq_len": 6})
    with pytest.raises(TesseraError, match=r"split seq over sp=2×tp=2 = 4 ways, which does not divide seq_len=6"):
        make_plan(CompileOptions.of(bad), program_graph(bad), devices=jax.devices()[:1] * 8)


# ---------------------------------------------------------------- the attention cases (in the subprocess)


def _attention_op(exp):
    """The first attention op of exp's graph, the graph, and random layer-0 parameters for it."""
    import jax

    from tessera.lower.interpret import param_bindings
    from tessera.lower.program import program_graph

    graph = program_graph(exp)
    repeat = next(op for op in graph.body.ops if op.name == "repeat")
    op = next(o for o in repeat.region.ops if o.name == "attention")
    params = {}
    for i, (name, path) in enumerate(param_bindings(op)):
        shape = tuple(d.size for d in graph.params[path].type.dims)[1:]  # one layer of the stack
        params[name] = 0.3 * jax.random.normal(jax.random.key(i), shape)
    return op, graph, params


def attention_cases() -> dict:
    """Per case: the attention lowering on sp=4 (blocks of 8 of 32 tokens) against one device, forward and grad."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from tessera.lower.context import LowerCtx
    from tessera.lower.interpret import resolve_attrs
    from tessera.lower.options import CompileOptions
    from tessera.lower.shard.step import make_plan
    from tessera.lower.table import get_lowering
    from tessera.spec import load_experiment
    from tests.lower.shard.worker import overrides

    exp = load_experiment(ROOT / GPT_OSS, overrides=overrides(GPT_OSS, {**SEQ, "task.seq_len": 32, "mesh.sp": 4}))
    op, graph, params = _attention_op(exp)
    plan = make_plan(CompileOptions.of(exp), graph, devices=jax.devices()[:4])
    lower = get_lowering("attention").fn
    x = jax.random.normal(jax.random.key(99), (2, 32, params["q"].shape[0]))
    w = jax.random.normal(jax.random.key(98), x.shape)
    out, refs = {}, {}
    cases = [(f"window={win}", {"window": win}) for win in WINDOWS] + [("bidirectional", {"causal": False})]
    for case, change in cases:
        attrs = {**resolve_attrs(op.attrs, 0), "window": None, **change}

        def one(x, ctx):
            return lower(ctx, op, attrs, [x], params, None)[0][0]

        def sharded(x):
            spec = P(None, "sp", None)
            return jax.shard_map(lambda b: one(b, LowerCtx(shard=plan.env)), mesh=plan.mesh, in_specs=spec,
                                 out_specs=spec)(x)

        def loss_and_grad(fn):  # (out, d sum(out * w) / dx) in one compile
            return jax.jit(jax.grad(lambda x: (jnp.sum(fn(x) * w), fn(x)), has_aux=True))(x)

        g_ref, ref = loss_and_grad(lambda x: one(x, LowerCtx()))
        g_got, got = loss_and_grad(sharded)
        refs[case] = ref
        out[case] = {"shape": list(got.shape), "max_err": float(jnp.max(jnp.abs(got - ref))),
                     "max_ref": float(jnp.max(jnp.abs(ref))), "grad_err": float(jnp.max(jnp.abs(g_got - g_ref))),
                     "grad_ref": float(jnp.max(jnp.abs(g_ref)))}
    for case in out:  # does the window change the answer (the case tests the mask, not only causality)?
        out[case]["window_bites"] = bool(jnp.max(jnp.abs(refs[case] - refs["window=None"])) > 1e-3)
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(attention_cases()))
