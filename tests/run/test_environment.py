"""The process settings of deterministic mode (`request_deterministic_kernels`) and of fp8 products
(`request_fp8_gemms`): which XLA flags a spec asks for, and that a flag the person set is theirs. Environment only, so in this process."""

from __future__ import annotations

import os

import pytest

from tessera.run.environment import (
    DETERMINISTIC_TRAIN_XLA_FLAGS,
    DETERMINISTIC_XLA_FLAGS,
    FP8_XLA_FLAGS,
    recorded_settings,
    request_deterministic_kernels,
    request_fp8_gemms,
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


def test_a_flag_is_the_persons_only_where_they_name_it(monkeypatch):
    """A flag of the person's whose name merely begins with one of Tessera's (here a made-up
    `--xla_gpu_deterministic_ops_report`) does not stand for it: Tessera's is still asked for."""
    ops = DETERMINISTIC_XLA_FLAGS[0]
    theirs = f"{ops.split('=')[0]}_report=true"
    flags = _flags(monkeypatch, ["parallel.deterministic=true", "task.kind=train"], flags=theirs).split()
    assert theirs in flags and ops in flags


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


FP8 = "numerics.default=fp8_e4m3 @scale(per_tensor) @accum(fp32)"
TRITON = FP8_XLA_FLAGS[0].split("=")[0]


def _fp8_flags(monkeypatch, overrides, flags=None):
    monkeypatch.setenv("XLA_FLAGS", flags or "")
    record = request_fp8_gemms(load_experiment("specs/llama_tiny.yaml", overrides))
    return record, os.environ["XLA_FLAGS"].split()


@pytest.mark.parametrize("overrides", [[FP8], [FP8, "task.kind=generate", "task.prompts=[hi]"],
                                       ["numerics.default=fp8_e5m2 @accum(fp32)"]])
def test_products_in_fp8_run_on_cublas(monkeypatch, overrides):
    record, flags = _fp8_flags(monkeypatch, overrides, flags="--xla_cpu_enable_fast_math=false")
    assert flags == ["--xla_cpu_enable_fast_math=false", *FP8_XLA_FLAGS]
    assert record == {"set_by": "tessera", "flags": list(FP8_XLA_FLAGS)}
    assert request_fp8_gemms(load_experiment("specs/llama_tiny.yaml", overrides)) == record  # a second call: same
    assert os.environ["XLA_FLAGS"].split() == flags


@pytest.mark.parametrize("overrides", [[], ["numerics.default=bf16 @accum(fp32)"],
                                       ['numerics.rules={"*/attention/q": "fp8_e4m3 @scale(per_block(8))"}']])
def test_a_program_without_fp8_products_keeps_xlas_gemms(monkeypatch, overrides):
    assert _fp8_flags(monkeypatch, overrides) == (None, [])


def test_the_persons_triton_setting_wins_over_fp8s(monkeypatch):
    record, flags = _fp8_flags(monkeypatch, [FP8], flags=f"{TRITON}=true")
    assert flags == [f"{TRITON}=true"] and record == {"set_by": "user", "flags": [f"{TRITON}=true"]}


def test_replay_of_an_fp8_run_turns_tritons_gemm_off_as_the_run_did(monkeypatch):
    spec = load_experiment("specs/llama_tiny.yaml", [FP8]).resolved()
    monkeypatch.setenv("XLA_FLAGS", "")
    assert request_fp8_gemms(recorded_settings(spec))["flags"] == list(FP8_XLA_FLAGS)
    assert os.environ["XLA_FLAGS"].split() == list(FP8_XLA_FLAGS)
