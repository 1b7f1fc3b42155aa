"""The run side of the spec contract (docs/contracts.md): a spec `tessera check` accepts runs, shortened to one
step of its task, to exit 0; a failure after a passing `check` is a breach (a traceback, or exit 1 for a reason
the spec caused). tests/spec/test_sweep.py is the check side, over the same settings.

    pytest -m sweep tests/spec/test_run_sweep.py    # every accepted setting, and random combinations of them

The core kept in `make test` runs the non-train task kinds' bases and a few training settings that change the compiled
program; the sweep (marker `sweep`, minutes) runs every setting the check side accepts, one at a time, then
random combinations of them (hypothesis).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.cli import main
from tessera.spec.schema import Experiment
from tests.cpu_env import cpu_env
from tests.lower.shard.make_snapshots import ROOT
from tests.spec.test_sweep import CASES, TASKS, _fields, _model_args, _spec_file, _task_fields

# one step of each task at the tiny specs' sizes, with no evaluation, checkpoint or sample to wait for
SHORT = {"train": {"task.steps": 1, "task.batch": 2, "task.seq_len": 16, "task.eval_every": 0, "task.sample": None,
                   "task.log_every": 1, "checkpoint.every": 0},
         "generate": {"task.max_new_tokens": 2}, "forward": {}, "bench": {"task.warmup": 0, "task.iters": 1}}
# settings the run side leaves out: sizes a CPU cannot hold or finish (check accepts 10**12 steps), and the
# ones SHORT sets itself
HUGE = 10_000


@pytest.fixture(autouse=True, scope="module")
def _no_persistent_cache():
    """Hundreds of programs compiled in one process: jax's persistent cache is off here. Writing to it crashed the
    sweep twice under two workers (an abort inside `put_executable_and_time`, serialising an executable); one
    process alone did not."""
    import jax

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", was)


def _setting(key: str, value) -> str:
    return f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


def _run(spec: Path, kind: str, extra: dict, out: Path, fresh: bool = False) -> str | None:
    """None if a one-step run of spec + extra exits 0, else what went wrong (the contract's breach). A mesh
    of several devices runs in a process with that many CPU devices (this one has one); so does every run
    given `fresh`."""
    sets = [_setting(k, v) for k, v in {**SHORT[kind], **extra}.items()]
    argv = ["run", str(spec), "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    devices = math.prod(v for k, v in extra.items()
                        if k.startswith("mesh.") and isinstance(v, int) and not isinstance(v, bool))  # not auto
    if devices > 1 or fresh:
        done = subprocess.run([sys.executable, "-m", "tessera.cli", *argv], env=cpu_env(devices), cwd=ROOT,
                              capture_output=True, text=True, timeout=900)
        return None if done.returncode == 0 else f"{' '.join(sets)}: exit {done.returncode}: {done.stderr[-400:]}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(argv)
    except Exception as exc:  # a traceback would reach the user
        return f"{' '.join(sets)}: {type(exc).__name__}: {exc}"
    return None if code == 0 else f"{' '.join(sets)}: exit {code}: {err.getvalue()[-400:]}"


def _runnable(kind: str, key: str, value) -> bool:
    if key in SHORT[kind] or key == "task.kind":
        return False
    return not (isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > HUGE)


def _accepted(spec: Path, kind: str | None) -> list[tuple[str, object]]:
    """The settings of the check side's sweep for this case that `check` accepts and a CPU can run."""
    if kind is None:
        candidates = _fields(Experiment) + _model_args(spec) + _task_fields("train")
    else:
        candidates = _task_fields(kind)
    ok = []
    for key, value in candidates:
        if not _runnable(kind or "train", key, value):
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                accepted = main(["check", str(spec), "--set", _setting(key, value)]) == 0
        except (Exception, SystemExit):  # a breach of the check side's contract, which test_sweep.py reports
            accepted = False
        if accepted:
            ok.append((key, value))
    return ok


@pytest.mark.parametrize("kind", ["generate", "forward", "bench"])  # train: the settings below, and tests/run
def test_the_base_of_each_task_kind_runs_one_step(tmp_path, kind):
    spec = _spec_file(tmp_path, "gpt_oss_tiny.yaml", TASKS[kind])
    assert _run(spec, kind, {}, tmp_path / "run") is None


@pytest.mark.parametrize("setting", [{"parallel.remat": "full"}, {"numerics.default": "bf16 @accum(fp32)"},
                                     {"task.optimizer.name": "sgd", "task.optimizer.momentum": 0.9}])
def test_settings_that_change_the_program_run(tmp_path, setting):
    spec = _spec_file(tmp_path, "llama_tiny.yaml", None)
    assert _run(spec, "train", setting, tmp_path / "run") is None


def pytest_generate_tests(metafunc):
    """One test per (case, accepted setting) when the sweep is selected: each runs in seconds under its own
    timeout, and xdist spreads them (a case's 66 settings in one test took over the 900 s timeout). `check`
    decides which settings are accepted, so the items are worked out only when `-m sweep` asks for them."""
    if metafunc.function is not test_every_accepted_setting_runs_one_step:
        return
    if "sweep" not in (metafunc.config.getoption("markexpr") or "").replace("not sweep", ""):
        metafunc.parametrize("base,kind,key,value", [(b, k, None, None) for b, k in CASES])
        return
    import tempfile
    items, ids = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n, (base, kind) in enumerate(CASES):
            (Path(tmp) / str(n)).mkdir()
            spec = _spec_file(Path(tmp) / str(n), base, TASKS[kind] if kind else None)
            accepted = _accepted(spec, kind)
            assert accepted, f"{base} {kind}: check accepts no setting"
            items += [(base, kind, key, value) for key, value in accepted]
            ids += [f"{base}-{kind or 'train'}-{_setting(key, value)}" for key, value in accepted]
    metafunc.parametrize("base,kind,key,value", items, ids=ids)


@pytest.mark.sweep
def test_every_accepted_setting_runs_one_step(tmp_path, base, kind, key, value):
    spec = _spec_file(tmp_path, base, TASKS[kind] if kind else None)
    assert key is not None, "run with -m sweep"
    # a process of its own, as `tessera run` is used: after ~40 programs compiled in one worker, XLA:CPU crashed
    # (a segmentation fault in compilation) on a setting that passes alone
    assert _run(spec, kind or "train", {key: value}, tmp_path / "run", fresh=True) is None


@pytest.mark.sweep
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_combinations_check_and_run(tmp_path_factory, data):
    """Two to four settings at once, each accepted alone: `check` refuses the combination with positions, or it
    runs one step."""
    base, kind = data.draw(st.sampled_from(CASES))
    tmp = tmp_path_factory.mktemp("combo")
    spec = _spec_file(tmp, base, TASKS[kind] if kind else None)
    pool = _ACCEPTED.setdefault((base, kind), _accepted(spec, kind))
    chosen = dict(data.draw(st.lists(st.sampled_from(pool), min_size=2, max_size=4, unique_by=lambda kv: kv[0])))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["check", str(spec), *itertools.chain.from_iterable(  # the settings as the run takes them
            ("--set", _setting(k, v)) for k, v in {**SHORT[kind or "train"], **chosen}.items())])
    assert code in (0, 2), err.getvalue()
    if code == 2:
        assert all(line.split(":")[1].isdigit() for line in err.getvalue().splitlines() if ": error: " in line)
        return
    assert _run(spec, kind or "train", chosen, tmp / "run") is None


_ACCEPTED: dict = {}
