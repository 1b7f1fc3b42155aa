"""The spectral mixture of experts on Burgers pairs from a spec: a short deterministic run (canonical batch shards)
whose held-out error falls, `tessera.load_run` mapping initial conditions [B, 64] to solutions [B, 64], no more
active parameters than the FNO's, expert parallelism (ep=2 on 8 CPU devices) reproducing one device bit for
bit, and positioned errors for what deterministic mode cannot do."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import tessera
from tessera.diagnostics import TesseraError
from tessera.ir.check import check_experiment
from tessera.ir.cost import param_summary
from tessera.run.environment import DETERMINISTIC_CPU_THREADS, DETERMINISTIC_XLA_FLAGS
from tessera.run.main import run_experiment
from tessera.run.pde import BurgersSource
from tests.lower.shard.conftest import run_jobs

ROOT = Path(__file__).resolve().parents[2]
SPEC, FNO = ROOT / "specs" / "spectral_moe_burgers.yaml", ROOT / "specs" / "fno_burgers.yaml"
SMALL = {"model.args.width": 8, "model.args.modes": 8, "model.args.bands": 2, "model.args.layers": 2,
         "model.args.proj": 16, "task.batch": 8, "task.data.train": 48, "task.data.eval": 16,
         "task.schedule.warmup_steps": 5, "task.optimizer.lr": 3e-3}
RUN = {**SMALL, "task.steps": 150, "task.eval_every": 75, "task.eval_batches": 2, "task.log_every": 25}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The Burgers pairs, solved once for the module (and by the 8-device subprocess, which reads them back)."""
    path = tmp_path_factory.mktemp("pde-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def smoe_run(cache, tmp_path_factory):
    exp = tessera.load(SPEC, overrides=RUN)
    return run_experiment(exp, out=tmp_path_factory.mktemp("smoe") / "run", stream=io.StringIO(), tensorboard=False)


def test_a_short_run_brings_the_held_out_error_down(smoe_run):
    evals = [r for r in smoe_run.metrics if "eval_rel_l2" in r]
    assert [r["step"] for r in evals] == [75, 150]
    first, last = smoe_run.metrics[0], smoe_run.metrics[-1]
    assert "relative_l2" in last and last["relative_l2"] < 0.5 * first["relative_l2"]
    prog, _ = tessera.load_run(smoe_run.run_dir)
    assert prog.canonical_objective  # deterministic mode: 8 samples in 8 canonical shards
    before = BurgersSource(prog.exp.task.data, 8).errors(lambda u: prog.forward(prog.init(0), u))["eval_rel_l2"]
    assert evals[-1]["eval_rel_l2"] < 0.5 * before


def test_l_bfgs_trains_on_canonical_shards(cache, tmp_path):
    """L-BFGS after Adam in deterministic mode: its line search differentiates the canonical-shard loss (whose
    per-shard loop JAX cannot reverse-differentiate: the gradient is the train step's own, as a custom VJP)."""
    exp = tessera.load(SPEC, overrides={**SMALL, "task.steps": 6, "task.eval_every": 0, "task.log_every": 1,
                                        "task.optimizer.lbfgs_after": 3})
    res = run_experiment(exp, out=tmp_path / "run", stream=io.StringIO(), tensorboard=False)
    losses = [r["loss"] for r in res.metrics if "loss" in r]
    assert len(losses) == 6 and np.isfinite(losses).all()
    assert losses[-1] < losses[3]  # the L-BFGS steps (4-6) go down hill


def test_load_run_maps_initial_conditions_to_solutions(smoe_run):
    prog, params = tessera.load_run(smoe_run.run_dir)
    u0, u1 = BurgersSource(prog.exp.task.data, 8).eval
    pred = np.asarray(prog.forward(params, u0))
    assert pred.shape == u1.shape == (16, 64)
    rel = np.mean(np.linalg.norm(pred - u1, axis=1) / np.linalg.norm(u1, axis=1))
    assert rel == pytest.approx(smoe_run.metrics[-1]["eval_rel_l2"], rel=1e-5)
    assert np.asarray(prog.forward(params, u0[:3])).shape == (3, 64)


def test_the_shipped_spec_has_no_more_active_parameters_than_the_fno():
    moe, fno = (param_summary(check_experiment(tessera.load(s))) for s in (SPEC, FNO))
    assert moe["active"] <= fno["active"] < moe["total"]


@pytest.mark.slow  # an 8-device subprocess compiling two programs: scheduled first (tests/conftest.py)
def test_expert_parallelism_reproduces_one_device_bit_for_bit(cache):
    """Two steps on one device and on ep=2 x dp=4 (the experts' weights split in two, gathered for each step's
    canonical shards): the same losses, gradient norms, parameters and held-out predictions."""
    jobs = [{"kind": "train_pde", "spec": str(SPEC), "steps": 2, "overrides": {**SMALL, **mesh}}
            for mesh in ({}, {"mesh.ep": 2, "mesh.dp": 4})]
    jobs += [{"kind": "gather", "spec": "", "overrides": {}}, {"kind": "ordered_sum", "spec": "", "overrides": {}}]
    one, ep, gathered, summed = run_jobs(jobs)
    # the gather behind it (deterministic mode's gather_full) returns every bit, -0.0 and NaN payloads included
    assert gathered and all(gathered.values()), gathered
    # and its gradient reduction (each device's subtree, then the devices in order) is the one-device tree's
    assert len(summed) == 6 and all(same and order_matters for same, order_matters in summed.values()), summed
    assert ep["collectives"] and not one["collectives"]
    assert ep["losses"] == one["losses"] and ep["norms"] == one["norms"] and one["losses"][0] != one["losses"][1]
    assert ep["checksum"] == one["checksum"] and ep["forward"] == one["forward"] and ep["state"] == one["state"]
    assert ep["expert_blocks"] == [2] and one["expert_blocks"] == [4]  # experts per device


# The smallest spectral MoE found whose ep=2 run stored other Adam moments than one device's after two steps
# (before the update was fenced: lower/shard/deterministic.py `fenced`).
TINY = {"model.args.width": 4, "model.args.modes": 4, "model.args.bands": 2, "model.args.layers": 1,
        "model.args.proj": 8, "task.batch": 8, "task.data.train": 16, "task.data.eval": 8}


@pytest.mark.slow  # an 8-device subprocess compiling two programs at LLVM's default level (~35 s on 2 cores)
def test_expert_parallelism_keeps_the_optimizer_state_bit_for_bit_as_a_run_compiles(cache):
    """ep=2 against one device, compiled as `tessera run` compiles in deterministic mode: its XLA flags and none of
    the suite's quick compile flags (at their LLVM level 0, XLA:CPU contracts no product and sum into an fma, and
    that is where ep=2 differed: its optimizer update, fused with the slice of each device's block, rounded Adam's
    first moment of the split experts as fma(0.9, mu, 0.1 g) where one device rounds fma(0.1, g, 0.9 mu)). The
    whole train state is compared: the moments differ a step before the parameters do."""
    flags = " ".join(["--xla_force_host_platform_device_count=8", *DETERMINISTIC_XLA_FLAGS])
    jobs = [{"kind": "train_pde", "spec": str(SPEC), "steps": 2, "overrides": {**TINY, **mesh}}
            for mesh in ({}, {"mesh.ep": 2})]
    one, ep = run_jobs(jobs, XLA_FLAGS=flags, PJRT_NPROC=DETERMINISTIC_CPU_THREADS)
    assert ep["expert_blocks"] == [2] and one["expert_blocks"] == [4]
    assert ep["losses"] == one["losses"] and ep["norms"] == one["norms"]
    assert ep["state"] == one["state"] and ep["checksum"] == one["checksum"] and ep["forward"] == one["forward"]


@pytest.mark.parametrize("spec, overrides, key, message", [
    (SPEC, {**SMALL, "mesh.ep": 2, "parallel.deterministic": False}, "parallel.deterministic",
     "models with loss entries run on a mesh in deterministic mode only"),
    (ROOT / "specs" / "pinn_kovasznay.yaml", {"mesh.dp": 2}, "mesh",
     "models with loss entries on collocation points run on one device for now"),
])
def test_what_a_mesh_cannot_run_is_a_positioned_error(spec, overrides, key, message):
    with pytest.raises(TesseraError) as exc:
        check_experiment(tessera.load(spec, overrides=overrides))
    d = exc.value.diagnostics[0]
    assert message in d.message and d.key == key and d.span is not None


def test_a_loss_term_that_is_not_a_mean_over_the_batch_is_refused_where_it_is_written(tmp_path):
    model = tmp_path / "m.tsl"
    model.write_text((ROOT / "models" / "spectral_moe.tsl").read_text().replace(
        "return mean(sum(d * d, over = [space]) / sum(u1 * u1, over = [space]), over = [batch])",
        "return sum(d * d, over = [space, batch]) / sum(u1 * u1, over = [space, batch])"))
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC.read_text().replace("../models/spectral_moe.tsl", str(model)))
    with pytest.raises(TesseraError) as exc:
        check_experiment(tessera.load(spec))
    d = exc.value.diagnostics[0]
    assert "`sum` combines values across `batch`" in d.message and "mean(..., over = [batch])" in d.message
    assert d.span.file == str(model) and model.read_text().splitlines()[d.span.line - 1].strip().startswith("return")
    check_experiment(tessera.load(spec, overrides={"parallel.deterministic": False}))  # one objective: allowed
