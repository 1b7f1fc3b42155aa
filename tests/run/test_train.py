"""The train task end to end on the fake program: learning, determinism, the run directory, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from runfake import FakeProgram, train_spec

from tessera.diagnostics import RunError, TesseraError
from tessera.run.manifest import FIXED_KEYS, params_checksum


def test_loss_falls_far_below_chance_and_sample_is_right(run_fake):
    result = run_fake(train_spec(steps=80, sample={"prompt": [0, 5, 6, 1], "max_new_tokens": 3}))
    chance = result.manifest["chance_loss"]
    assert math.isclose(chance, math.log(16))
    first, last = result.metrics[0], result.metrics[-1]
    assert first["loss"] > 0.9 * chance
    assert last["loss"] < 0.05 * chance and last["eval_loss"] < 0.05 * chance
    prompted, check = result.manifest["samples"]
    assert prompted["prompt"] == [0, 5, 6, 1] and len(prompted["output"]) == 3
    assert check["correct"] == 1.0 and check["output"] == check["expected"]
    assert result.status == "completed" and result.exit_code == 0


def test_two_runs_identical_and_manifest_complete(run_fake, small_spec, tmp_path):
    a = run_fake(small_spec, out=tmp_path / "a")
    b = run_fake(small_spec, out=tmp_path / "b")
    assert a.metrics == b.metrics and len(a.metrics) == 30
    assert [r["step"] for r in a.metrics] == list(range(1, 31))
    assert a.params_checksum == b.params_checksum and len(a.params_checksum) == 64
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert all(k in m for k in FIXED_KEYS)
    assert m["spec"] == small_spec and m["seed"] == 0 and m["status"] == "completed"
    assert m["data_fingerprint"] and m["versions"]["jax"] and m["devices"][0]["platform"] == jax.default_backend()
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert lines == m["metrics"]
    steps = sorted(int(p.name) for p in (tmp_path / "a" / "ckpt").iterdir() if p.name.isdigit())
    assert steps == [20, 30]  # every 10, keep 2


def test_checksum_is_sha256_of_sorted_param_bytes(run_fake, small_spec):
    import hashlib

    prog = FakeProgram(__import__("runfake").FakeExperiment(small_spec))
    params = prog.init(0)
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(np.asarray(params[k]).tobytes())
    assert params_checksum(params) == h.hexdigest()


def test_resume_with_more_steps_is_bit_identical(run_fake, small_spec, tmp_path):
    whole = run_fake(small_spec, out=tmp_path / "whole")
    short = dict(small_spec, task={**small_spec["task"], "steps": 20})
    run_fake(short, out=tmp_path / "part")
    resumed = run_fake(small_spec, out=tmp_path / "part")  # same --out: continues from step 20
    assert resumed.manifest["resumed"][0]["from_step"] == 20
    assert resumed.metrics == whole.metrics
    assert resumed.params_checksum == whole.params_checksum


def test_incompatible_checkpoint_is_refused_naming_fields(run_fake, small_spec, tmp_path):
    run_fake(small_spec, out=tmp_path / "r")
    other = json.loads(json.dumps(small_spec))
    other["task"]["optimizer"]["lr"] = 0.5
    other["model"]["args"]["d_model"] = 32
    with pytest.raises(TesseraError) as err:
        run_fake(other, out=tmp_path / "r")
    keys = [d.key for d in err.value.diagnostics]
    assert keys == ["model.args.d_model", "task.optimizer.lr"]
    assert "checkpoint has 64, spec has 32" in err.value.diagnostics[0].message
    assert json.loads((tmp_path / "r" / "manifest.json").read_text())["status"] == "completed"  # untouched


def test_nan_names_step_and_tensor_and_keeps_last_checkpoint(run_fake, small_spec, tmp_path):
    poisoned = lambda exp: FakeProgram(exp, poison_after=25)
    with pytest.raises(RunError) as err:
        run_fake(small_spec, out=tmp_path / "nan", program=poisoned)
    msg = str(err.value)
    assert "at step 26" in msg and "parameter `mlp/up`" in msg and "last good checkpoint: step 20" in msg
    m = json.loads((tmp_path / "nan" / "manifest.json").read_text())
    assert m["status"] == "failed" and "step 26" in m["error"]
    assert [r["step"] for r in m["metrics"]] == list(range(1, 21))  # flushed records survive; no NaN recorded
    assert max(int(p.name) for p in (tmp_path / "nan" / "ckpt").iterdir() if p.name.isdigit()) == 20


def test_out_of_memory_is_a_plain_run_error(run_fake, small_spec, tmp_path):
    class Oom(FakeProgram):
        def train_step(self, state, batch):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.")

    expected = f"out of memory on {jax.default_backend()}: RESOURCE_EXHAUSTED.*reduce task.batch"
    with pytest.raises(RunError, match=expected):
        run_fake(small_spec, out=tmp_path / "oom", program=Oom)
    assert json.loads((tmp_path / "oom" / "manifest.json").read_text())["status"] == "failed"


def test_tensorboard_events_written(run_fake, small_spec, tmp_path):
    run_fake(dict(small_spec, task={**small_spec["task"], "steps": 5}), out=tmp_path / "tb", tensorboard=True)
    events = list((tmp_path / "tb" / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 100


def test_failure_while_compiling_is_recorded(run_fake, small_spec, tmp_path):
    def broken(exp):
        raise RunError("lowering failed: no kernel for op `frobnicate`")

    with pytest.raises(RunError, match="frobnicate"):
        run_fake(small_spec, out=tmp_path / "c", program=broken)
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert m["status"] == "failed" and "frobnicate" in m["error"] and m["ir_hash"] is None and m["ended_at"]


def test_train_on_a_token_file(run_fake, small_spec, tmp_path):
    import hashlib

    from tessera.run.data import write_bin

    write_bin(tmp_path / "d.bin", np.tile(np.arange(20), 50))  # a repeating pattern: easy to predict
    data = {"kind": "tokens", "path": str(tmp_path / "d.bin"), "seed": 0}
    spec = dict(small_spec, task={**small_spec["task"], "steps": 20, "data": data})
    result = run_fake(spec, out=tmp_path / "t")
    assert result.manifest["data_fingerprint"] == hashlib.sha256((tmp_path / "d.bin").read_bytes()).hexdigest()
    assert result.metrics[-1]["loss"] < 0.5 * result.metrics[0]["loss"]
    assert "samples" not in result.manifest and "chance_loss" not in result.manifest


def test_a_second_run_into_a_directory_another_run_is_writing_is_refused(run_fake, small_spec, tmp_path):
    """Another process holds the run directory: this run is refused before it writes anything; once that
    process is gone (killed, even) the directory is free again."""
    import subprocess
    import sys

    out = tmp_path / "shared"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from tessera.run.main import exclusive\n"
         f"with exclusive(Path({str(out)!r})):\n    print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunError, match=r"shared is being written by another tessera run \(pid \d+, started"):
            run_fake(small_spec, out=out)
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing of this run was written
    finally:
        holder.kill()
        holder.wait()
    assert run_fake(small_spec, out=out).status == "completed"


def _largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete"])
def test_damaged_checkpoint_is_refused_at_resume_and_the_previous_offered(run_fake, small_spec, tmp_path, damage):
    """A corrupted, cut-short or missing tensor file in the latest checkpoint stops --resume with the step
    named and the older checkpoint offered; set aside as told, the run continues from that one exactly."""
    spec = dict(small_spec, checkpoint={**small_spec.get("checkpoint", {}), "every": 10, "keep": 3})
    whole = run_fake(spec, out=tmp_path / "whole")
    short = dict(spec, task={**spec["task"], "steps": 20})
    run_fake(short, out=tmp_path / "r")  # checkpoints 10 and 20
    data = _largest_file(tmp_path / "r" / "ckpt" / "20" / "state")
    if damage == "flip a byte":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    else:
        data.unlink()
    with pytest.raises(RunError) as err:
        run_fake(spec, out=tmp_path / "r")
    msg = str(err.value)
    assert "checkpoint at step 20" in msg and "is damaged" in msg and "older checkpoints: 10" in msg, msg
    if damage == "flip a byte":  # the chunks are compressed: the flip breaks the decoding or changes the bits
        assert "1 tensor(s) differ from what was written" in msg or "cannot be read" in msg, msg
    move = msg.split("(mv ")[1].split(")")[0].split()
    Path(move[0]).rename(move[1])
    resumed = run_fake(spec, out=tmp_path / "r")
    assert resumed.manifest["resumed"][-1]["from_step"] == 10
    assert resumed.metrics == whole.metrics and resumed.params_checksum == whole.params_checksum


def test_a_tensor_that_differs_from_its_digest_is_refused(tmp_path):
    """Bits that decode but are not the ones written (the digest stored beside them disagrees) are refused, with
    the tensor named; the untouched checkpoint restores."""
    import jax.numpy as jnp

    from tessera.run.checkpoint import Checkpoints, DamagedCheckpoint

    state = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(3)}
    ckpts = Checkpoints(tmp_path / "ckpt", keep=2)
    ckpts.save(1, state, {"step": 1})
    ckpts.wait()
    restored, meta = ckpts.restore(1, state)
    assert meta == {"step": 1} and bool(jnp.all(restored["w"] == state["w"]))
    record = tmp_path / "ckpt" / "1" / "meta" / "metadata"
    written = json.loads(record.read_text())
    written["digest"]["['w']"][0] += 1  # as if w's bits had changed after the write
    record.write_text(json.dumps(written))
    with pytest.raises(DamagedCheckpoint, match=r"1 tensor\(s\) differ from what was written: \['w'\]"):
        ckpts.restore(1, state)


def test_disk_full_during_a_save_stops_the_run_and_keeps_the_previous_checkpoint(run_fake, small_spec, tmp_path,
                                                                                  monkeypatch):
    """The save of step 20 fails as a full disk fails it, after writing part of its temporary directory: the
    run stops with a plain error naming the step and the intact checkpoint, and --resume continues from it."""
    import errno

    import orbax.checkpoint as ocp

    spec = dict(small_spec, checkpoint={"dir": "ckpt", "every": 10, "keep": 3})
    whole = run_fake(spec, out=tmp_path / "whole")
    real_save = ocp.CheckpointManager.save

    def full_disk(self, step, *args, **kwargs):
        if step == 20:
            (Path(self.directory) / "20.orbax-checkpoint-tmp-1").mkdir()  # what a cut-off save leaves
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(RunError) as err:
        run_fake(spec, out=tmp_path / "r")
    msg = str(err.value)
    assert "checkpoint at step 20 could not be written" in msg and "No space left on device" in msg, msg
    assert "the checkpoint at step 10 is intact" in msg, msg
    assert json.loads((tmp_path / "r" / "manifest.json").read_text())["status"] == "failed"
    monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)
    resumed = run_fake(spec, out=tmp_path / "r", resume=True)
    assert resumed.manifest["resumed"][-1]["from_step"] == 10
    assert resumed.metrics == whole.metrics and resumed.params_checksum == whole.params_checksum


def test_tokens_per_s_times_the_training_steps_not_the_evaluation(run_fake, monkeypatch):
    # a clock that stands still except in the evaluation, which takes 1000 s: a rate that counted the
    # evaluation's time would be at most 20 steps x 256 tokens / 1000 s
    from tessera.run.tasks import train as train_task

    now = [0.0]
    monkeypatch.setattr(train_task.time, "perf_counter", lambda: now[0])
    real = train_task.Trainer.evaluate

    def slow_evaluate(self):
        now[0] += 1000.0
        return real(self)

    monkeypatch.setattr(train_task.Trainer, "evaluate", slow_evaluate)
    result = run_fake(train_spec(steps=20, eval_every=20, log_every=20))
    assert "eval_loss" in result.metrics[-1]
    assert result.manifest["tokens_per_s"] > 1e6  # the steps' own time: the clock did not move for them


def test_a_diverging_deterministic_run_names_the_tensor_without_a_traceback(tmp_path):
    """Deterministic mode's loss (opaque loops over the canonical shards) is not differentiable from outside, so
    the diagnosis once ended a divergent run in a Python traceback; it now names the first parameter whose update
    went non-finite, from one more step."""
    from tessera.run.main import run_experiment
    from tessera.spec import load_experiment

    root = Path(__file__).resolve().parents[2]
    exp = load_experiment(str(root / "specs" / "llama_tiny.yaml"), overrides={
        "task.steps": 4, "task.optimizer.lr": 1e8, "task.schedule.warmup_steps": 0, "task.log_every": 1,
        "task.eval_every": 0, "task.batch": 4, "task.seq_len": 16, "checkpoint.every": 0})
    assert exp.parallel.deterministic
    with pytest.raises(RunError) as err:
        run_experiment(exp, out=tmp_path / "run", tensorboard=False)
    msg = str(err.value)
    assert "became nan at step 2" in msg and "first non-finite tensor: the update of `" in msg, msg
