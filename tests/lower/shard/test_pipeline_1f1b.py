"""The 1F1B pipeline schedule (fast mode) against GPipe and one device: loss curves, gradients, and the
compiled train step's temp memory (1F1B keeps O(pp) stage inputs alive, GPipe every tick's residuals).

The 8-device runs happen in two subprocesses side by side (`python -m tests.lower.shard.test_pipeline_1f1b`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.lower.shard.conftest import DEVICES, ROOT, assert_trained_close
from tests.cpu_env import cpu_env

pytestmark = pytest.mark.slow  # compiles on 8 devices: scheduled first (tests/conftest.py)

GPT_OSS, LLAMA = "specs/gpt_oss_tiny.yaml", "specs/llama_tiny.yaml"
FAST = {"parallel.deterministic": False, "task.batch": 16}
PP2 = {"mesh.pp": 2, "mesh.tp": 2, "mesh.dp": 2, "parallel.pipeline.microbatches": 8}
PP4 = {"mesh.pp": 4, "parallel.pipeline.schedule": "1f1b"}  # llama: 1 layer per stage (GPT-OSS needs 2)
JOBS = {
    "gpt_oss": [
        ("train", GPT_OSS, "1 device", {}),
        ("train", GPT_OSS, "gpipe", {**PP2, "parallel.pipeline.schedule": "gpipe"}),
        ("train", GPT_OSS, "1f1b", {**PP2, "parallel.pipeline.schedule": "1f1b"}),
        ("grads", GPT_OSS, "gpipe", {**PP2, "parallel.pipeline.schedule": "gpipe"}),
        ("grads", GPT_OSS, "1f1b", {**PP2, "parallel.pipeline.schedule": "1f1b"}),
    ],
    "llama": [
        ("grads", LLAMA, "1 device", {}),
        ("grads", LLAMA, "pp=4,dp=2,M=4", {**PP4, "mesh.dp": 2, "parallel.pipeline.microbatches": 4}),
        ("grads", LLAMA, "pp=4,fsdp=2,M=8", {**PP4, "mesh.fsdp": 2, "parallel.pipeline.microbatches": 8}),
        ("train", LLAMA, "1 device", {}),
        ("train", LLAMA, "1f1b", {**PP2, "parallel.pipeline.schedule": "1f1b"}),
        # the parallel report of the spec as given (not the worker's small model): in this process, not its own
        ("collectives", LLAMA, "gpipe", {"parallel.pipeline.schedule": "gpipe"}),
        ("collectives", LLAMA, "1f1b", {"parallel.pipeline.schedule": "1f1b"}),
    ],
}


# ---- the subprocess side ---------------------------------------------------------------------------
def _program(spec: str, extra: dict):
    from tessera.lower.program import compile_experiment
    from tessera.run.optim import build_optimizer, current_lr
    from tessera.spec import load_experiment
    from tests.lower.shard.worker import overrides

    exp = load_experiment(spec, overrides=overrides(spec, {**FAST, **extra}))
    return exp, compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)


def train(spec: str, extra: dict) -> dict:
    """Two train steps through the compiled step: losses, final parameters (a prefix), temp bytes."""
    import jax
    from tests.lower.shard.worker import batches

    exp, prog = _program(spec, extra)
    state = prog.init_train_state(prog.init(0))
    data = list(batches(2, exp.task.batch, exp.task.seq_len))
    with jax.default_matmul_precision(prog.matmul_precision):
        step = jax.jit(prog.train_step_fn()).lower(state, data[0]).compile()
    losses = []
    for batch in data:
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    params = {k: np.asarray(v, np.float64).ravel()[:256].tolist() for k, v in state.params.items()}
    return {"losses": losses, "params": params, "temp": step.memory_analysis().temp_size_in_bytes}


def grads(spec: str, extra: dict) -> dict:
    """The loss and every parameter's gradient on the first batch."""
    import jax
    from tests.lower.shard.worker import batches

    exp, prog = _program(spec, extra)
    batch = next(batches(1, exp.task.batch, exp.task.seq_len))
    with jax.default_matmul_precision(prog.matmul_precision):
        loss, g = jax.jit(jax.value_and_grad(prog.loss_fn()))(prog.init(0), batch)
    return {"loss": float(loss), "grads": {k: np.asarray(v, np.float64).ravel().tolist() for k, v in g.items()}}


def collectives(spec: str, extra: dict) -> list[str]:
    """The parallel report's collectives of a pp=2 x dp=4 program under `extra`'s schedule (compiled, not run)."""
    import tessera

    prog = tessera.compile(tessera.load(spec, overrides={"mesh.pp": 2, "mesh.dp": 4, "parallel.deterministic": False,
                                                         "parallel.pipeline.microbatches": 2, **extra}))
    return prog.parallel_report()["collectives"]


def main() -> None:
    jobs = json.loads(sys.argv[1])
    kinds, out = {"train": train, "grads": grads, "collectives": collectives}, []
    for kind, spec, name, extra in jobs:
        start = time.perf_counter()
        out.append(kinds[kind](spec, extra))
        print(f"{kind} {spec} {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print("RESULT " + json.dumps(out))


# ---- the test side -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results():
    """{(model, kind, name): result} from two 8-device subprocesses run side by side."""
    env = cpu_env(DEVICES)
    procs = {model: subprocess.Popen([sys.executable, "-m", "tests.lower.shard.test_pipeline_1f1b", json.dumps(jobs)],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for model, jobs in JOBS.items()}
    out = {}
    for model, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0 and "RESULT " in stdout, stderr[-4000:]
        for (kind, _, name, _), res in zip(JOBS[model], json.loads(stdout.split("RESULT ", 1)[1])):
            out[(model, kind, name)] = res
    return out


def _close(got: dict, ref: dict, rtol: float = 1e-5) -> None:
    """Every tensor within rtol of the reference, relative to its norm."""
    assert got.keys() == ref.keys()
    for path, values in ref.items():
        a, b = np.asarray(got[path]), np.asarray(values)
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b) + 1e-9, path


@pytest.mark.parametrize("model", ["gpt_oss", "llama"])
def test_1f1b_loss_curve_matches_one_device(results, model):
    ref, got = results[(model, "train", "1 device")], results[(model, "train", "1f1b")]
    assert ref["losses"][1] != ref["losses"][0]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert_trained_close(got["params"], ref["params"])


def test_1f1b_matches_gpipe(results):
    gpipe, got = results[("gpt_oss", "train", "gpipe")], results[("gpt_oss", "train", "1f1b")]
    np.testing.assert_allclose(got["losses"], gpipe["losses"], rtol=1e-5)
    g_gpipe, g_1f1b = results[("gpt_oss", "grads", "gpipe")], results[("gpt_oss", "grads", "1f1b")]
    assert g_1f1b["loss"] == pytest.approx(g_gpipe["loss"], rel=1e-6)
    assert any(np.linalg.norm(v) > 1e-3 for v in g_gpipe["grads"].values())
    _close(g_1f1b["grads"], g_gpipe["grads"])


@pytest.mark.parametrize("mesh", ["pp=4,dp=2,M=4", "pp=4,fsdp=2,M=8"])
def test_1f1b_four_stages_match_one_device(results, mesh):
    ref, got = results[("llama", "grads", "1 device")], results[("llama", "grads", mesh)]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    _close(got["grads"], ref["grads"])  # tied embedding: its grad sums the first and the last stage's


def test_1f1b_needs_less_temp_memory_than_gpipe(results):
    """pp=2, M=8: GPipe keeps all M + pp - 1 ticks' residuals for its backward, 1F1B a ring of 2pp - 1 inputs
    (121.5 against 235.1 KB since remat none keeps each op's results only, interpret.KEEP_RESULTS: every tick's
    residuals are smaller, the rest of the temporaries not)."""
    gpipe, got = results[("gpt_oss", "train", "gpipe")]["temp"], results[("gpt_oss", "train", "1f1b")]["temp"]
    assert got < 0.6 * gpipe, (got, gpipe)


def test_manifest_names_the_1f1b_collectives(results):
    """The parallel report says which schedule's collectives the step uses."""
    gpipe, onef = results[("llama", "collectives", "gpipe")], results[("llama", "collectives", "1f1b")]
    assert "ppermute(activations between pipeline stages over pp)" in gpipe
    assert "ppermute(activations forward, input grads back between pipeline stages over pp: 1F1B)" in onef
    assert onef[-1] == "psum(stage grads over the data axes and pp, once per step)"


if __name__ == "__main__":
    main()
