"""Deterministic mode's process settings (`request_deterministic_kernels`): which XLA flags a spec asks for, and
that a flag the person set is theirs. Environment only, so in this process."""

from __future__ import annotations

import os

import pytest

from tessera.run.environment import (
    DETERMINISTIC_TRAIN_XLA_FLAGS,
    DETERMINISTIC_XLA_FLAGS,
    recorded_settings,
    request_deterministic_kernels,
)
from tessera.spec import load_experiment

MERGER = DETERMINISTIC_TRAIN_XLA_FLAGS[0].split("=")[0]


def _flags(monkeypatch, overrides, flags=None) -> str:
    if flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.setenv("PJRT_NPROC", os.environ.get("PJRT_NPROC", "1"))  # restored after the test
    request_deterministic_kernels(load_experiment("specs/llama_tiny.yaml", overrides))
    return os.environ.get("XLA_FLAGS", "")


@pytest.mark.parametrize(
    "overrides, merges",
    [
        (["task.kind=train"], False),  # a train step turns dot merging off
        (["task.kind=bench", "task.what=[forward, train_step]"], False),  # so does a bench that times one
        (["task.kind=bench", "task.what=[forward]"], True),
        (["task.kind=generate", "task.prompts=[hi]"], True),  # decode keeps XLA's merging (faster there)
    ],
)
def test_a_deterministic_step_that_trains_turns_dot_merging_off(monkeypatch, overrides, merges):
    flags = _flags(monkeypatch, ["parallel.deterministic=true", *overrides]).split()
    assert set(DETERMINISTIC_XLA_FLAGS) <= set(flags)
    assert (DETERMINISTIC_TRAIN_XLA_FLAGS[0] in flags) is not merges


def test_fast_mode_asks_for_nothing(monkeypatch):
    assert _flags(monkeypatch, ["parallel.deterministic=false", "task.kind=train"]) == ""


def test_the_persons_dot_merger_setting_wins(monkeypatch):
    mine = f"{MERGER}=64"
    flags = _flags(monkeypatch, ["parallel.deterministic=true", "task.kind=train"], flags=mine).split()
    assert mine in flags and DETERMINISTIC_TRAIN_XLA_FLAGS[0] not in flags


@pytest.mark.parametrize("overrides", [["task.kind=train"], ["task.kind=bench", "task.what=[forward, train_step]"],
                                       ["task.kind=generate", "task.prompts=[hi]"], ["parallel.deterministic=false"]])
def test_replay_settles_the_process_as_the_run_it_replays(monkeypatch, overrides):
    """`tessera replay` reads the manifest's recorded spec (resolved, as the manifest keeps it) before JAX starts:
    the same XLA flags as the run had, the dot-merger one included where it trained."""
    exp = load_experiment("specs/llama_tiny.yaml", ["parallel.deterministic=true", *overrides])
    ran = _flags(monkeypatch, ["parallel.deterministic=true", *overrides])
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    request_deterministic_kernels(recorded_settings(exp.resolved()))
    assert os.environ.get("XLA_FLAGS", "") == ran
