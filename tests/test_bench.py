"""The benchmark helpers that need no GPU: reading a profiler trace's GPU rows, the timing program."""

from __future__ import annotations

import gzip
import json

import pytest

from bench import trace


def _write(path, events):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_gpu_events_come_from_the_device_rows(tmp_path, capsys):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}]
    kernels = [{"ph": "X", "pid": 7, "name": "attn", "ts": 10.0 * i, "dur": 6.0} for i in range(4)]
    kernels += [{"ph": "X", "pid": 7, "name": "merge", "ts": 10.0 * i + 6, "dur": 2.0} for i in range(4)]
    host = [{"ph": "X", "pid": 1, "name": "dispatch", "ts": 0.0, "dur": 50.0}]
    _write(tmp_path / "plugins" / "x.trace.json.gz", meta + kernels + host)
    events = trace._gpu_events(tmp_path)
    assert sorted({e["name"] for e in events}) == ["attn", "merge"] and len(events) == 8
    trace.report(events, calls=4)
    out = capsys.readouterr().out
    assert "GPU busy 8.0 us per call over a span of 9.5 us per call" in out
    assert "6.0 us  75.0%  attn" in out and "2.0 us  25.0%  merge" in out


def test_a_trace_without_gpu_rows_says_what_it_saw(tmp_path):
    _write(tmp_path / "t.json.gz", [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}])
    with pytest.raises(SystemExit, match="/host:CPU"):
        trace._gpu_events(tmp_path)


def test_rotating_program_runs_every_call_on_its_own_input():
    import jax.numpy as jnp
    from bench.kernels import rotating_program

    many, args = rotating_program(lambda w, x: w * x, (jnp.float32(3.0),), [jnp.arange(4.0) + i for i in range(5)])
    outs = many(*args)
    assert len(outs) == 5
    for i, out in enumerate(outs):
        assert out.tolist() == [3.0 * (v + i) for v in range(4)]

