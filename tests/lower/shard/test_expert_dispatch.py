"""Expert parallelism by all_to_all dispatch (fast mode): the dispatch alone against the reference MoE on skewed
routing, the capacity's drops against a count made in numpy, training on expert meshes against one device, and
the moe_dropped metric in a run's metrics.jsonl.

The checks that need 8 devices run in two subprocesses side by side (`python -m tests.lower.shard.test_expert_dispatch
JOB`); each prints its results as JSON.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from pathlib import Path

import numpy as np
import pytest

from tests.lower.shard.conftest import DEVICES, ROOT, assert_trained_close
from tests.cpu_env import cpu_env

pytestmark = pytest.mark.slow  # compiles on 8 devices: scheduled first (tests/conftest.py)

GPT_OSS = "specs/gpt_oss_tiny.yaml"
E, K, D, F = 8, 2, 16, 8  # experts, top_k, d_model, d_ff of the dispatch cases
CAPACITY = 0.5
# (name, mesh axes, rules {logical: mesh axes}, capacity): ep beside dp (each device routes a 1/ep slice of the
# tokens its ep group shares), and ep splitting the batch with d_ff split over tp (psum of partials)
CASES = [("dp=2,ep=4", {"dp": 2, "ep": 4}, {"batch": ("dp",), "experts": ("ep",)}),
         ("ep=4 (batch),tp=2", {"ep": 4, "tp": 2}, {"batch": ("ep",), "experts": ("ep",), "mlp": ("tp",)})]
TRAIN_MESHES = {"1 device": {},
                "ep=4,dp=2 (batch over ep)": {"mesh.ep": 4, "mesh.dp": 2, "parallel.rules.batch": ["dp", "ep"]},
                "fsdp=2,tp=2,ep=2 (capacity 8)": {"mesh.fsdp": 2, "mesh.tp": 2, "mesh.ep": 2,
                                                  "parallel.expert_capacity": 8.0}}


# ---- device side (runs in the subprocess) ----------------------------------------------------------------------

def _moe_inputs(seed: int, tokens: int):
    """x [tokens, D] and MoE params whose routing is skewed: expert 0 is chosen by most tokens, expert 5 by none."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
    bias = np.zeros(E, np.float32)
    bias[0], bias[5] = 4.0, -1e4
    p = {"router": f32(D, E) * 0.5, "router_bias": bias, "experts/gate": f32(E, D, F) * 0.3,
         "experts/up": f32(E, D, F) * 0.3, "experts/down": f32(E, F, D) * 0.3, "experts/gate_bias": f32(E, F) * 0.1,
         "experts/up_bias": f32(E, F) * 0.1, "experts/down_bias": f32(E, D) * 0.1}
    return f32(tokens, D), p


def _reference_parts(x, p):
    """(routing weights [T, k], experts [T, k], every expert on every token [T, E, D]) on one device."""
    import jax.numpy as jnp
    from tessera.lower.reference import moe as moe_ref

    w, ex = moe_ref.route(jnp.asarray(x), router=p["router"], router_bias=p["router_bias"], top_k=K)
    dense = moe_ref._expert_ffn_dense(jnp.asarray(x), p["experts/gate"], p["experts/up"], p["experts/down"],
                                      p["experts/gate_bias"], p["experts/up_bias"], p["experts/down_bias"],
                                      moe_ref.GPT_OSS_ACT)
    return np.asarray(w), np.asarray(ex), np.asarray(dense)


def _dispatch(name, axes, rules, x, p, capacity):
    """(y [b, s, D], dropped copies summed over the mesh, grad of sum(y·ct) wrt x) through expert.moe."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    from tessera.ir.passes.shard import AxisRules
    from tessera.lower.reference import moe as moe_ref
    from tessera.lower.shard import expert
    from tessera.lower.shard.collectives import ShardEnv

    mesh = Mesh(np.asarray(jax.devices()[:DEVICES]).reshape(tuple(axes.values())), tuple(axes))
    env = ShardEnv(AxisRules(tuple(rules.items()), tuple(axes.items())), ())
    spec = lambda dims: P(*[(rules.get(d) or (None,))[0] for d in dims])
    specs = {"router": P(), "router_bias": P(), "experts/gate": spec(("experts", None, "mlp")),
             "experts/up": spec(("experts", None, "mlp")), "experts/down": spec(("experts", "mlp", None)),
             "experts/gate_bias": spec(("experts", "mlp")), "experts/up_bias": spec(("experts", "mlp")),
             "experts/down_bias": spec(("experts", None))}
    xs = P(rules["batch"][0], None, None)

    def local(x, p):
        y, dropped = expert.moe(env, x, p, top_k=K, act=moe_ref.GPT_OSS_ACT, capacity=capacity)
        return y, expert.step_count(env, dropped)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(xs, specs), out_specs=(xs, P()))
    x3 = jnp.asarray(x).reshape(8, -1, D)
    ct = jnp.asarray(np.random.default_rng(7).standard_normal(x3.shape).astype(np.float32))

    def probe(x):  # sum(y·ct) and its input gradient, with y and the count: one compile
        y, dropped = fn(x, p)
        return jnp.sum(y * ct), (y, dropped)

    (_, (y, dropped)), gx = jax.jit(jax.value_and_grad(probe, has_aux=True))(x3)
    return np.asarray(y).reshape(-1, D), int(dropped), np.asarray(gx).reshape(-1, D), np.asarray(ct).reshape(-1, D)


def _sources(name: str, tokens: int) -> list[np.ndarray]:
    """The token ids each device routes, in order (what the dispatch promises, written out per case)."""
    if name.startswith("dp=2,ep=4"):  # dp blocks of the batch; ep devices take quarters of their block
        return [np.arange(tokens).reshape(2, 4, -1)[i, j] for i in range(2) for j in range(4)]
    return [np.arange(tokens).reshape(4, -1)[i] for i in range(4)]  # ep splits the batch; tp duplicates


def numpy_drops(experts: np.ndarray, sources, shards: int, capacity: float | None) -> np.ndarray:
    """kept [T, k] bool: a source keeps its first `slots` copies per destination shard, in (token, k) order."""
    e_local = E // shards
    kept = np.ones(experts.shape, bool)
    for rows in sources:
        n = len(rows)
        slots = n * min(K, e_local)
        if capacity is not None:
            slots = min(slots, math.ceil(capacity * n * K / shards))
        used = np.zeros(shards, int)
        for t in rows:
            for j in range(K):
                d = experts[t, j] // e_local
                kept[t, j] = used[d] < slots
                used[d] += 1
    return kept


def dispatch_case(name, axes, rules) -> dict:
    """Dropless and capacity-limited dispatch vs the reference on one mesh."""
    import jax
    import jax.numpy as jnp

    tokens = 8 * 12
    x, p = _moe_inputs(len(name), tokens)
    w, ex, dense = _reference_parts(x, p)
    shards = axes["ep"]
    out = {"load": np.bincount(ex.ravel(), minlength=E).tolist()}
    for label, cap in (("dropless", None), ("capacity", CAPACITY)):
        y, dropped, gx, ct = _dispatch(name, axes, rules, x, p, cap)
        kept = numpy_drops(ex, _sources(name, tokens), shards, cap)
        combine = np.zeros((tokens, E), np.float32)
        np.add.at(combine, (np.arange(tokens)[:, None].repeat(K, 1), ex), np.where(kept, w, 0.0))
        want = np.einsum("te,ted->td", combine, dense)
        gwant = jax.grad(lambda x: jnp.sum(_kept_moe(x, p, kept) * ct))(jnp.asarray(x))
        out[label] = {"err": float(np.abs(y - want).max()), "scale": float(np.abs(want).max()),
                      "grad_err": float(np.abs(gx - np.asarray(gwant)).max()),
                      "grad_scale": float(np.abs(np.asarray(gwant)).max()),
                      "dropped": dropped, "numpy_dropped": int((~kept).sum())}
    return out


def _kept_moe(x, p, kept):
    """The reference MoE with the copies where `kept` is False removed (routing itself differentiable)."""
    import jax.numpy as jnp
    from tessera.lower.reference import moe as moe_ref

    w, ex = moe_ref.route(x, router=p["router"], router_bias=p["router_bias"], top_k=K)
    dense = moe_ref._expert_ffn_dense(x, p["experts/gate"], p["experts/up"], p["experts/down"],
                                      p["experts/gate_bias"], p["experts/up_bias"], p["experts/down_bias"],
                                      moe_ref.GPT_OSS_ACT)
    picked = jnp.take_along_axis(dense, ex[:, :, None], axis=1)  # [T, k, D]
    return jnp.einsum("tk,tkd->td", jnp.where(kept, w, 0.0), picked)


def train_case(extra: dict) -> dict:
    """Losses and the first parameters after 2 fast-mode steps, with the metrics the step reports."""
    from tessera.lower.program import compile_experiment
    from tessera.run.optim import build_optimizer, current_lr
    from tessera.spec import load_experiment
    from tests.lower.shard.worker import batches, host, overrides

    exp = load_experiment(GPT_OSS, overrides=overrides(GPT_OSS, {"parallel.deterministic": False, **extra}))
    prog = compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)
    state = prog.init_train_state(prog.init(0))
    losses, dropped = [], []
    for batch in batches(2, exp.task.batch, exp.task.seq_len):
        state, m = prog.train_step(state, batch)
        losses.append(float(m["loss"]))
        dropped.append(int(m["moe_dropped"]) if "moe_dropped" in m else None)
    return {"losses": losses, "dropped": dropped, "collectives": prog.collectives,
            "params": {k: host(v).astype(np.float64).ravel()[:64].tolist() for k, v in state.params.items()}}


def run_case(out_dir: str) -> dict:
    """A 2-step `run_experiment` with a small capacity on ep=4×dp=2: its metrics.jsonl records."""
    from tessera.run.main import run_experiment
    from tessera.spec import load_experiment
    from tests.lower.shard.worker import overrides

    extra = {"parallel.deterministic": False, "mesh.ep": 4, "mesh.dp": 2, "parallel.expert_capacity": CAPACITY,
             "task.steps": 2, "task.log_every": 1, "task.eval_every": 0, "task.sample": None,
             "checkpoint.every": 0}
    exp = load_experiment(GPT_OSS, overrides=overrides(GPT_OSS, extra))
    run_experiment(exp, out=out_dir, tensorboard=False, stream=open(os.devnull, "w"))
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return {"records": [json.loads(line) for line in lines]}


def main(job: str) -> dict:
    """One subprocess's share: the dispatch cases and the run, or the training comparison."""
    if job == "dispatch":
        import tempfile
        out = {name: dispatch_case(name, axes, rules) for name, axes, rules in CASES}
        with tempfile.TemporaryDirectory() as d:
            out["run"] = run_case(d)
        return out
    return {name: train_case(extra) for name, extra in TRAIN_MESHES.items()}


# ---- test side -------------------------------------------------------------------------------------------------

def _start(job: str) -> subprocess.Popen:
    env = cpu_env(DEVICES)
    return subprocess.Popen([sys.executable, "-m", "tests.lower.shard.test_expert_dispatch", job], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0 and "RESULT " in out, err[-4000:]
    return json.loads(out.split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def results():
    """{"dispatch": ..., "train": ...}: two 8-device subprocesses side by side (CI has two cores)."""
    procs = {job: _start(job) for job in ("dispatch", "train")}
    return {job: _finish(proc) for job, proc in procs.items()}


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_dropless_dispatch_equals_the_reference(results, case):
    got = results["dispatch"][case]
    load = got["load"]
    assert load[0] >= 0.4 * sum(load) and load[5] == 0  # skewed: expert 0 serves ≥ 80% of tokens, expert 5 none
    d = got["dropless"]
    assert d["dropped"] == 0 and d["numpy_dropped"] == 0
    assert d["err"] <= 1e-5 * d["scale"] and d["grad_err"] <= 1e-5 * d["grad_scale"]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_capacity_drops_exactly_the_counted_copies(results, case):
    c = results["dispatch"][case]["capacity"]
    assert c["dropped"] > 0 and c["dropped"] == c["numpy_dropped"]
    assert c["err"] <= 1e-5 * c["scale"] and c["grad_err"] <= 1e-5 * c["grad_scale"]


@pytest.mark.parametrize("mesh", [m for m in TRAIN_MESHES if m != "1 device"])
def test_training_on_expert_meshes_agrees_with_one_device(results, mesh):
    ref, got = results["train"]["1 device"], results["train"][mesh]
    assert any(c.startswith("all_to_all(expert dispatch") for c in got["collectives"])
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert_trained_close(got["params"], ref["params"])


def test_metric_is_reported_only_with_a_capacity(results):
    train = results["train"]
    assert train["1 device"]["dropped"] == [None, None]  # no capacity: no metric
    assert train["fsdp=2,tp=2,ep=2 (capacity 8)"]["dropped"] == [0, 0]  # a capacity above the worst case


def test_dropped_copies_reach_metrics_jsonl(results):
    records = results["dispatch"]["run"]["records"]
    assert [r["step"] for r in records] == [1, 2]
    dropped = [r["moe_dropped"] for r in records]
    # tiny gpt_oss (4 layers, 4 experts, top-2) on ep=4×dp=2: each device routes 8 tokens, 16 copies, per
    # layer; capacity 0.5 gives ceil(0.5·16/4) = 2 slots per shard, 8 in all: 8 to 15 of 16 dropped per device
    # and layer, on 8 devices and 4 layers
    assert all(d == int(d) and 8 * 8 * 4 <= d < 16 * 8 * 4 for d in dropped), dropped


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])))
