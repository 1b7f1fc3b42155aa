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


def test_report_subtracts_a_base_trace_kernel_by_kernel(capsys):
    """generate(16) minus generate(1): what 15 decode steps add, per step."""
    ev = lambda name, ts, dur: {"name": name, "ts": ts, "dur": dur}  # noqa: E731
    base = [ev("prefill", 0.0, 50.0), ev("step", 60.0, 10.0)]
    events = base + [ev("step", 80.0 + 20 * i, 10.0) for i in range(15)] + [ev("merge", 85.0 + 20 * i, 2.0)
                                                                           for i in range(15)]
    trace.report(events, calls=15, base=base)
    out = capsys.readouterr().out
    assert "GPU busy 12.0 us per call over a span of 20.0 us per call" in out
    assert "1.0x      10.0 us  83.3%  step" in out and "1.0x       2.0 us  16.7%  merge" in out
    assert "prefill" not in out  # cancelled by the base


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


def test_ncu_durations_are_read_per_kernel_in_launch_order():
    """bench.ncu reads ncu's details page: kernel header lines (C++ signatures included), then
    each kernel's Duration in its unit."""
    from bench.ncu import parse_durations
    text = """==PROF== Connected to process 1172 (/usr/bin/python3.12)
[1172] python3.12@127.0.0.1
  void cudnn::compute_dot_do_o_specialized<1, 64>(const void *, void *, unsigned int) (4096, 1, 1)x(256, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    SM Frequency                    Ghz         1.59
    Duration                         us       193.63
  cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26 (132, 1, 1)x(384, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Elapsed Cycles                cycle    2,203,820
    Duration                         ms         4.04
  anonymous_mosaic_gpu_kernel (4, 32, 8)x(384, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Duration                    msecond     1,002.5
"""
    got = parse_durations(text)
    assert [n for n, _ in got] == [
        "void cudnn::compute_dot_do_o_specialized<1, 64>(const void *, void *, unsigned int)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26",
        "anonymous_mosaic_gpu_kernel"]
    assert [round(ms, 5) for _, ms in got] == [0.19363, 4.04, 1002.5]
    with pytest.raises(ValueError, match="unknown unit 'furlong'"):
        parse_durations("  k (1, 1, 1)x(1, 1, 1), Context 1\n    Duration  furlong  3\n")
