"""generate, forward and bench through `run`, on the fake program."""

from __future__ import annotations

import os

import numpy as np
import pytest
from runfake import FakeExperiment, FakeProgram

from tessera.diagnostics import RunError
from tessera.run.tasks.bench import peak_flops


def _spec(task: dict, vocab: int = 260) -> dict:
    return {"name": "fake", "model": {"file": "fake.tsl", "args": {"vocab": vocab, "d_model": 16}},
            "task": task, "checkpoint": {"dir": "ckpt", "every": 0, "keep": 1}}


def _gen_task(**kw) -> dict:
    task = {"kind": "generate", "seed": 3, "prompts": ["hi there", [5, 6, 7]], "tokenizer": "bytes",
            "max_new_tokens": 6, "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0}, "stop_tokens": []}
    task.update(kw)
    return task


def test_generate_through_run_equals_program_generate(run_fake):
    spec = _spec(_gen_task(sampling={"temperature": 0.8, "top_k": 5, "top_p": 1.0}))
    result = run_fake(spec)
    prog = FakeProgram(FakeExperiment(spec))
    params = prog.init(3)
    for prompt, out in zip([list(b"hi there"), [5, 6, 7]], result.manifest["outputs"]):
        want = np.asarray(prog.generate(params, np.asarray([prompt], np.int32), max_new_tokens=6, temperature=0.8,
                                        top_k=5, seed=3))[0, len(prompt):]
        assert out["prompt"] == prompt and out["tokens"] == want.tolist()
        assert out["text"] == bytes(t for t in want.tolist() if t < 256).decode("utf-8", "replace")
    speed = result.manifest["speed"]
    assert speed["prefill_tokens_per_s"] > 0 and speed["decode_tokens_per_s"] > 0
    assert result.manifest["metrics"][0]["tokens_sha256"] and result.params_checksum


def test_generate_cuts_at_stop_tokens_and_checks_ids(run_fake, tmp_path):
    plain = run_fake(_spec(_gen_task(prompts=[[1, 2]])), out=tmp_path / "a").manifest["outputs"][0]["tokens"]
    stop = plain[2]
    cut = run_fake(_spec(_gen_task(prompts=[[1, 2]], stop_tokens=[stop])), out=tmp_path / "b")
    assert cut.manifest["outputs"][0]["tokens"] == plain[:plain.index(stop) + 1]
    with pytest.raises(RunError, match="prompt 0 has token id 999 outside the vocabulary of 260"):
        run_fake(_spec(_gen_task(prompts=[[999]])), out=tmp_path / "c")
    with pytest.raises(RunError, match="prompt 0 is text but task.tokenizer is 'none'"):
        run_fake(_spec(_gen_task(tokenizer="none")), out=tmp_path / "d")


def test_forward_writes_logits(run_fake, tmp_path):
    tokens = [[1, 2, 3, 4], [5, 6, 7, 8]]
    spec = _spec({"kind": "forward", "seed": 1, "tokens": tokens, "tokens_file": None, "out": "logits.npy"})
    result = run_fake(spec, out=tmp_path / "f")
    logits = np.load(tmp_path / "f" / "logits.npy")
    prog = FakeProgram(FakeExperiment(spec))
    assert logits.shape == (2, 4, 260)
    assert np.array_equal(logits, np.asarray(prog.forward(prog.init(1), np.asarray(tokens, np.int32))))
    np.save(tmp_path / "t.npy", np.asarray(tokens))
    spec["task"].update(tokens=None, tokens_file=str(tmp_path / "t.npy"), out="out/l.npy")
    again = run_fake(spec, out=tmp_path / "g")
    assert np.array_equal(np.load(tmp_path / "g" / "out" / "l.npy"), logits)
    assert again.metrics == result.metrics
    cache = again.manifest["compilation_cache"]  # the suite's cache, set in tests/conftest.py: the person's
    assert cache["set_by"] == "user" and cache["dir"] == os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert isinstance(cache["hits"], int) and cache["hits"] >= 0 and cache["saved_s"] >= 0.0
    from tessera.run.environment import autotuning

    # off in tests/conftest.py; how XLA picks kernels follows this process's XLA_FLAGS
    assert again.manifest["autotune_cache"] == {"set_by": "user", "dir": None, "autotuning": autotuning()}


def test_bench_reports_phases(run_fake):
    task = {"kind": "bench", "seed": 0, "batch": 2, "seq_len": 8, "warmup": 1, "iters": 2, "decode_tokens": 4,
            "what": ["compile", "forward", "train_step", "decode"]}
    result = run_fake(_spec(task, vocab=32))
    bench = result.manifest["bench"]
    assert set(bench) == {"forward", "train_step", "decode", "compile"}
    for phase in ("forward", "train_step", "decode"):
        assert bench[phase]["tokens_per_s"] > 0 and bench[phase]["min_s"] <= bench[phase]["median_s"]
    assert bench["forward"]["flops_per_token"] == FakeProgram(FakeExperiment(_spec(task, 32))).flops_per_token()[
        "forward"]
    peak = peak_flops()  # None on the CPU: no MFU there
    assert bench["forward"]["mfu"] == (None if peak is None else pytest.approx(
        bench["forward"]["flops_per_token"] * bench["forward"]["tokens_per_s"] / peak))
    assert set(bench["compile"]) == {"forward", "train_step", "decode"}
