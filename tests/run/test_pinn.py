"""Physics-informed training from a spec: collocation samplers, exact solutions, short PINN runs whose error
against the analytic solution falls, `tessera.load_run` on them, and positioned spec errors."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest

import tessera
from tessera.diagnostics import TesseraError
from tessera.run.collocation import CollocationSource, kovasznay, latin, sobol, taylor_green
from tessera.run.main import run_experiment

ROOT = Path(__file__).resolve().parents[2]
KOV, TG = ROOT / "specs" / "pinn_kovasznay.yaml", ROOT / "specs" / "pinn_taylor_green.yaml"


def _data(path, **overrides):
    return tessera.load(path, overrides=overrides).task.data


def test_samplers_are_pure_functions_of_seed_and_draw():
    src = CollocationSource(_data(TG, **{"task.data.resample_every": 10}))
    a, b = src.batch(3), src.batch(7)
    assert set(a) == {"interior", "initial", "initial_target", "boundary", "boundary_target"}
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])  # one draw for steps 0..9
    c = src.batch(10)
    assert not np.array_equal(a["interior"], c["interior"])
    np.testing.assert_array_equal(c["interior"], CollocationSource(src.data).batch(19)["interior"])
    np.testing.assert_allclose(np.asarray(c["interior"]), src.draw(1)["interior"], rtol=1e-6)  # f32 without x64
    other = CollocationSource(_data(TG, **{"task.data.resample_every": 10, "task.data.seed": 1}))
    assert not np.array_equal(other.batch(3)["interior"], a["interior"])
    fixed = CollocationSource(_data(TG))  # resample_every 0: the same points every step
    np.testing.assert_array_equal(fixed.batch(0)["interior"], fixed.batch(999)["interior"])


def test_point_sets_lie_where_they_say():
    src = CollocationSource(_data(KOV))
    inner, edge = src.draw(0)["interior"], src.draw(0)["boundary"]
    lo, hi = np.array([-0.5, -0.5]), np.array([1.0, 1.5])
    assert ((inner > lo) & (inner < hi)).all() and inner.shape == (1000, 2)
    on_face = np.isclose(edge, lo) | np.isclose(edge, hi)
    assert on_face.any(axis=1).all()
    sides = np.isclose(edge[:, 0], lo[0]).mean(), np.isclose(edge[:, 1], lo[1]).mean()
    assert abs(sides[0] - 2 / 7) < 0.06 and abs(sides[1] - 1.5 / 7) < 0.06  # a face ∝ its length (perimeter 7)
    np.testing.assert_allclose(src.draw(0)["boundary_target"], kovasznay(edge, src.data.exact))
    tg = CollocationSource(_data(TG)).draw(0)
    assert (tg["initial"][:, 2] == 0.0).all() and (tg["interior"][:, 2] > 0).all()


def test_sobol_and_latin_hypercube_stratify():
    rng = np.random.default_rng(0)
    pts = sobol(64, 3, rng)
    for d in range(3):  # a (0, m, 1)-net in each coordinate: one point per interval of width 1/64
        assert sorted(np.floor(pts[:, d] * 64).astype(int).tolist()) == list(range(64))
    cells = np.floor(pts[:, :2] * 8).astype(int)  # dims 1-2 of Sobol: one point in each of the 8 x 8 squares
    assert len({tuple(c) for c in cells}) == 64
    lh = latin(50, 2, rng)
    for d in range(2):
        assert sorted(np.floor(lh[:, d] * 50).astype(int).tolist()) == list(range(50))
    assert not np.array_equal(sobol(64, 3, np.random.default_rng(1)), pts)  # the shift depends on the seed


def _fd_residuals(exact_fn, exact, pts, h, time):
    """Momentum and continuity residuals of an exact solution by central differences."""
    f = lambda p: exact_fn(p, exact)  # noqa: E731
    d = lambda k: (f(pts + h * np.eye(pts.shape[1])[k]) - f(pts - h * np.eye(pts.shape[1])[k])) / (2 * h)  # noqa: E731
    dd = lambda k: (f(pts + h * np.eye(pts.shape[1])[k]) - 2 * f(pts) + f(pts - h * np.eye(pts.shape[1])[k])) / h ** 2  # noqa: E731
    F, fx, fy = f(pts), d(0), d(1)
    ft = d(2) if time else 0 * F
    nu = exact.nu if time else 1 / exact.re
    lap = dd(0) + dd(1)
    u, v = F[:, 0], F[:, 1]
    mx = ft[:, 0] + u * fx[:, 0] + v * fy[:, 0] + fx[:, 2] - nu * lap[:, 0]
    my = ft[:, 1] + u * fx[:, 1] + v * fy[:, 1] + fy[:, 2] - nu * lap[:, 1]
    return np.abs(mx).max(), np.abs(my).max(), np.abs(fx[:, 0] + fy[:, 1]).max()


@pytest.mark.parametrize("spec, fn, time", [(KOV, kovasznay, False), (TG, taylor_green, True)])
def test_exact_solutions_solve_navier_stokes(spec, fn, time):
    src = CollocationSource(_data(spec))
    assert max(_fd_residuals(fn, src.data.exact, src.held_out()[:500], 1e-4, time)) < 1e-5


TINY = {"numerics.default": "fp32", "numerics.params": "fp32", "task.optimizer.lbfgs_after": None,
        "task.optimizer.lr": 3e-3, "task.log_every": 50, "task.eval_every": 150, "checkpoint.every": 0}


@pytest.fixture(scope="module")
def kovasznay_run(tmp_path_factory):
    overrides = {**TINY, "model.args.width": 16, "model.args.depth": 2, "task.steps": 300,
                 "task.data.sets.interior.n": 256, "task.data.sets.boundary.n": 128, "task.data.eval_points": 512}
    exp = tessera.load(KOV, overrides=overrides)
    out = tmp_path_factory.mktemp("kov") / "run"
    return run_experiment(exp, out=out, stream=io.StringIO(), tensorboard=False)


def test_a_pinn_run_reports_points_a_second_not_tokens(kovasznay_run):
    """A PINN's throughput is collocation points a second (both sets', 256 + 128 a step), not tokens."""
    m = kovasznay_run.manifest
    assert m["samples_per_s"] > 0 and "tokens_per_s" not in m
    from tessera.run.tasks.train import _throughput

    assert _throughput(tessera.load(KOV)) == (("samples/s", "samples_per_s"), 1000 + 256)


def _untrained_errors(run_dir) -> dict:
    """rel_l2 of the run's network at its initial parameters, on the run's held-out points."""
    prog, _ = tessera.load_run(run_dir)
    params = prog.init(int(prog.exp.task.seed))
    return CollocationSource(prog.exp.task.data).errors(lambda pts: prog.forward(params, pts))


def test_a_short_kovasznay_run_brings_the_error_down(kovasznay_run):
    evals = [r for r in kovasznay_run.metrics if "rel_l2_u" in r]
    assert [r["step"] for r in evals] == [150, 300]
    first, last = kovasznay_run.metrics[0], kovasznay_run.metrics[-1]
    assert {"momentum_x", "momentum_y", "continuity", "boundary", "loss"} <= set(last)
    weighted = last["momentum_x"] + last["momentum_y"] + last["continuity"] + 10 * last["boundary"]
    assert math.isclose(last["loss"], weighted, rel_tol=1e-5)  # task.loss_weights: boundary 10, the rest 1
    assert last["loss"] < 0.2 * first["loss"]
    before = _untrained_errors(kovasznay_run.run_dir)
    assert evals[-1]["rel_l2_u"] < 0.5 * before["rel_l2_u"] and evals[-1]["rel_l2_p"] < 0.5 * before["rel_l2_p"]


def test_load_run_evaluates_a_trained_pinn_on_points(kovasznay_run):
    prog, params = tessera.load_run(kovasznay_run.run_dir)
    src = CollocationSource(prog.exp.task.data)
    pts = src.held_out()
    uvp = np.asarray(prog.forward(params, pts))
    assert uvp.shape == (512, 3)
    from tessera.run.collocation import relative_errors

    got = relative_errors(uvp.astype(np.float64), src.exact(pts))
    assert math.isclose(got["rel_l2_u"], kovasznay_run.metrics[-1]["rel_l2_u"], rel_tol=1e-6)


def test_a_short_taylor_green_run_brings_the_error_down(tmp_path):
    overrides = {**TINY, "model.args.width": 16, "model.args.depth": 2, "task.steps": 300,
                 "task.data.sets.interior.n": 256, "task.data.sets.initial.n": 128, "task.data.sets.boundary.n": 64,
                 "task.data.eval_points": 512}
    result = run_experiment(tessera.load(TG, overrides=overrides), out=tmp_path / "run", stream=io.StringIO(),
                            tensorboard=False)
    before = _untrained_errors(result.run_dir)
    after = result.metrics[-1]
    assert after["rel_l2_u"] < 0.3 * before["rel_l2_u"] and after["rel_l2_v"] < 0.3 * before["rel_l2_v"]
    assert result.metrics[-1]["loss"] < 0.2 * result.metrics[0]["loss"]


@pytest.mark.parametrize("old, new, key, message, word", [
    ("boundary: 10.0}", "boundery: 10.0}", "task.loss_weights.boundery",
     "model `kovasznay` has no loss term `boundery`", "boundery"),
    ("      boundary: {where", "      edge: {where", "task.data.sets", "takes input `boundary`, which no point set gives",
     "sets:"),
    ("domain: {x: [-0.5, 1.0], y: [-0.5, 1.5]}", "domain: {x: [-0.5, 1.0], y: [-0.5, 1.5], z: [0, 1]}",
     "task.data.domain", "the domain has 3 coordinates", "z: [0, 1]"),
    ("kind: collocation", "kind: synthetic", "task.data.kind", "it trains on collocation points, burgers pairs or sudoku puzzles, not `synthetic` data",
     "synthetic"),
])
def test_spec_mistakes_are_positioned_errors(tmp_path, old, new, key, message, word):
    from tessera.ir.check import check_experiment

    text = KOV.read_text().replace("../models/kovasznay.tsl", str(ROOT / "models" / "kovasznay.tsl"))
    assert old in text
    if new.startswith("kind: synthetic"):  # a language-model data section: the collocation keys go too
        text = text.split("  data:")[0] + "  data: {kind: synthetic}\n" + text.split("  eval_every")[1].join(["  eval_every", ""])
    else:
        text = text.replace(old, new)
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(TesseraError) as exc:
        check_experiment(tessera.load(path))
    d = exc.value.diagnostics[0]
    assert message in d.message and d.key == key
    assert d.span is not None and d.span.file.endswith("spec.yaml")
    line = text.splitlines()[d.span.line - 1]
    assert word in line


@pytest.mark.parametrize("overrides, message", [
    ({"task.loss_weights": {"boundary": 1.0}}, "names no loss terms"),
    ({"task.optimizer.name": "lbfgs"}, "L-BFGS needs a deterministic objective"),
    ({"task.optimizer.lbfgs_after": 10}, "L-BFGS needs a deterministic objective"),
])
def test_a_language_model_takes_no_loss_weights_nor_lbfgs(overrides, message):
    from tessera.ir.check import check_experiment

    exp = tessera.load(ROOT / "specs" / "llama_tiny.yaml", overrides=overrides)
    with pytest.raises(TesseraError, match=message):
        check_experiment(exp)


def _reference_kovasznay(params: dict, batch: dict, width: int, re: float):
    """The Kovasznay objective written directly in JAX: the model file's network (Glorot-scaled linear layers)
    and residuals, independently of the model language."""
    import jax
    import jax.numpy as jnp

    k_in, k_h, k_out = (math.sqrt(2 / (width + 2)) / 0.02, math.sqrt(1 / width) / 0.02,
                        math.sqrt(2 / (width + 3)) / 0.02)

    def net(xy):
        h = jnp.tanh(k_in * (xy @ params["net/input/weight"] + params["net/input/bias"]))
        for w, b in zip(params["net/layers/linear/weight"], params["net/layers/linear/bias"]):
            h = jnp.tanh(k_h * (h @ w + b))
        return k_out * (h @ params["net/output/weight"] + params["net/output/bias"])

    xy = jnp.asarray(batch["interior"])
    ex, ey = jnp.zeros_like(xy).at[:, 0].set(1.0), jnp.zeros_like(xy).at[:, 1].set(1.0)
    d = lambda f, e: (lambda z: jax.jvp(f, (z,), (e,))[1])  # noqa: E731
    f, fx, fy = net(xy), d(net, ex)(xy), d(net, ey)(xy)
    lap = d(d(net, ex), ex)(xy) + d(d(net, ey), ey)(xy)
    u, v = f[:, 0], f[:, 1]
    mx = u * fx[:, 0] + v * fy[:, 0] + fx[:, 2] - lap[:, 0] / re
    my = u * fx[:, 1] + v * fy[:, 1] + fy[:, 2] - lap[:, 1] / re
    miss = net(jnp.asarray(batch["boundary"])) - jnp.asarray(batch["boundary_target"])
    terms = {"momentum_x": jnp.mean(mx ** 2), "momentum_y": jnp.mean(my ** 2),
             "continuity": jnp.mean((fx[:, 0] + fy[:, 1]) ** 2), "boundary": jnp.mean(jnp.sum(miss ** 2, axis=1))}
    return terms["momentum_x"] + terms["momentum_y"] + terms["continuity"] + 10 * terms["boundary"], terms


def test_the_kovasznay_objective_and_its_gradient_match_plain_jax():
    import jax

    overrides = {**TINY, "model.args.width": 8, "model.args.depth": 3, "task.data.sets.interior.n": 64,
                 "task.data.sets.boundary.n": 32}
    exp = tessera.load(KOV, overrides=overrides)
    prog = tessera.compile(exp)
    batch = CollocationSource(exp.task.data).batch(0)
    key = jax.random.key(1)
    params = {k: v + 0.01 * jax.random.normal(jax.random.fold_in(key, i), v.shape, v.dtype)  # biases not all 0
              for i, (k, v) in enumerate(prog.init(0).items())}
    got, got_terms = jax.jit(prog.objective)(params, batch)
    want, want_terms = jax.jit(lambda p, b: _reference_kovasznay(p, b, 8, 20.0))(params, batch)
    for name in want_terms:
        assert math.isclose(float(got_terms[name]), float(want_terms[name]), rel_tol=2e-4), name
    g_got = jax.jit(jax.grad(lambda p: prog.objective(p, batch)[0]))(params)
    g_want = jax.jit(jax.grad(lambda p: _reference_kovasznay(p, batch, 8, 20.0)[0]))(params)
    for path in params:
        np.testing.assert_allclose(np.asarray(g_got[path]), np.asarray(g_want[path]), rtol=2e-3, atol=1e-4,
                                   err_msg=path)


@pytest.mark.slow
def test_an_lbfgs_step_reuses_the_line_search_value_and_gradient(monkeypatch):
    """After its first step, L-BFGS takes the objective's value and gradient at the step's params from the line
    search that accepted them (one differentiation of the objective a step, not two): the step's metrics are
    still those of its params and its batch. The first step on a new draw of points differentiates afresh."""
    import jax
    import optax

    from tessera.lower.program import Program
    from tessera.lower.train_step import linesearch_state

    calls = []
    objective = Program.objective

    def counted(self, params, batch):
        jax.debug.callback(lambda: calls.append(1))
        return objective(self, params, batch)

    overrides = {**TINY, "task.optimizer.lbfgs_after": 2, "model.args.width": 8, "model.args.depth": 2,
                 "task.data.sets.interior.n": 64, "task.data.sets.boundary.n": 32, "task.data.resample_every": 5}
    exp = tessera.load(KOV, overrides=overrides)
    prog = tessera.compile(exp)
    source = CollocationSource(exp.task.data)
    monkeypatch.setattr(Program, "objective", counted)
    state = prog.init_train_state(prog.init(0))
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: objective(prog, p, b)[0]))
    weights = exp.task.loss_weights
    for step in range(8):
        batch = source.batch(step)
        value, grad = value_and_grad(state.params, batch)
        calls.clear()
        state, m = prog.train_step(state, batch)
        jax.block_until_ready(m)
        jax.effects_barrier()
        trials = int(linesearch_state(state.opt_state).info.num_linesearch_steps)
        # Adam, L-BFGS's first step and the first on new points (step 5): the step's own evaluation (+ the line
        # search's trials); otherwise the trials only
        assert len(calls) == (1 if step < 2 else trials + (step in (2, 5))), step
        np.testing.assert_allclose(float(m["loss"]), float(value), rtol=1e-5)
        np.testing.assert_allclose(float(m["grad_norm"]), float(optax.tree.norm(grad)), rtol=1e-4)
        total = sum(float(weights.get(k, 1.0)) * float(m[k]) for k in ("momentum_x", "momentum_y", "continuity",
                                                                         "boundary"))
        np.testing.assert_allclose(total, float(m["loss"]), rtol=1e-5)
