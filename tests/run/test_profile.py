"""`tessera profile`: HLO and trace reading on fixed inputs, one real profile of a tiny train step on the CPU
(time per IR op and phase, the trace file, the manifest), and the plan's per-op times against its step time."""

from __future__ import annotations

import gzip
import json

import pytest

from tessera.run import trace as tr

HLO = """HloModule jit_step, entry_computation_layout={(f32[8,4]{1,0})->f32[8,4]{1,0}}

%fused_computation.1 (param_0: f32[8,4], param_1: f32[4,4]) -> f32[8,4] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  %mul.1 = f32[8,4]{1,0} multiply(%param_0, %param_0), metadata={op_name="jit(step)/transpose(jvp(layers/mlp))/mul"}
  ROOT %tanh.2 = f32[8,4]{1,0} tanh(%mul.1), metadata={op_name="jit(step)/transpose(jvp(layers/mlp))/tanh"}
}

%body.3 (arg_tuple.1: (s32[], f32[8,4], /*index=2*/f32[8,4])) -> (s32[], f32[8,4]) {
  %arg_tuple.1 = (s32[], f32[8,4]{1,0}, /*index=2*/f32[8,4]{1,0}) parameter(0)
  %fusion.1 = f32[8,4]{1,0} fusion(%arg_tuple.1), kind=kLoop, calls=%fused_computation.1
  %all-reduce-start.2 = f32[8,4]{1,0} all-reduce-start(%fusion.1), replica_groups=[2,4]<=[8], to_apply=%add
  %all-reduce-done.2 = f32[8,4]{1,0} all-reduce-done(%all-reduce-start.2)
  ROOT %tuple.9 = (s32[], f32[8,4]{1,0}) tuple(%arg_tuple.1, %all-reduce-done.2)
}

ENTRY %main.4 (Arg_0.1: f32[8,4]) -> f32[8,4] {
  %Arg_0.1 = f32[8,4]{1,0} parameter(0), metadata={op_name="params[\\'layers/mlp/up\\']"}
  %dot.5 = f32[8,4]{1,0} dot(%Arg_0.1, %Arg_0.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/decode/layers/attention/dot_general"}
  %copy.6 = f32[8,4]{1,0} copy(%dot.5)
  %ag.7 = bf16[8,16]{1,0} all-gather(%copy.6), replica_groups={{0,1},{2,3}}, dimensions={1}, metadata={op_name="jit(step)/optimizer/all_gather"}
  ROOT %while.8 = (s32[], f32[8,4]{1,0}) while(%copy.6), condition=%cond, body=%body.3
}
"""
LABELS = ["layers/mlp", "layers/attention", "layers/attn_norm/rmsnorm", "embed/unembed", "loss", "optimizer"]


def test_parse_hlo_reads_metadata_shapes_and_groups():
    ops = tr.parse_hlo(HLO)
    assert tr.module_name(HLO) == "jit_step"
    assert ops["fusion.1"].op_name == "jit(step)/transpose(jvp(layers/mlp))/tanh"  # from its fused root
    assert ops["fusion.1"].opcode == "fusion" and ops["fusion.1"].bytes == 8 * 4 * 4
    assert (ops["all-reduce-start.2"].opcode, ops["all-reduce-start.2"].group) == ("all-reduce-start", 4)
    assert (ops["ag.7"].group, ops["ag.7"].bytes) == (2, 8 * 16 * 2)
    assert ops["while.8"].opcode == "while" and ops["copy.6"].op_name == ""


@pytest.mark.parametrize("op_name,opcode,want", [
    ("jit(step)/transpose(jvp(layers/mlp))/tanh", "", ("backward", "layers/mlp")),
    ("jit(step)/while/body/jvp()/layers/attn_norm/rmsnorm/mul", "", ("forward", "layers/attn_norm/rmsnorm")),
    ("jit(step)/decode/layers/attention/dot_general", "", ("decode", "layers/attention")),
    ("jit(step)/prefill/embed/unembed/dot_general", "", ("prefill", "embed/unembed")),
    ("jit(step)/jvp(loss)/reduce_max", "", ("forward", "loss")),
    ("jit(step)/optimizer/mul", "", ("optimizer", "optimizer")),
    ("jit(step)/while/body/dynamic_slice", "", ("forward", "(other: dynamic_slice)")),
    ("", "copy", ("forward", "(other: copy)")),
    ("params['layers/mlp/up']", "copy", ("forward", "(other: inputs)")),
    ("jit(step)/layers/attention_x/dot_general", "", ("forward", "(other: dot_general)")),  # whole names only
])
def test_attribute_names_the_innermost_ir_op_and_the_phase(op_name, opcode, want):
    assert tr.attribute(op_name, sorted(LABELS, key=len, reverse=True), opcode) == want


def _trace(tmp_path, events: list[dict]):
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return path


def _ev(tid, name, op, dur, pid=1, module="jit_step"):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": dur, "ts": 0,
            "args": {"hlo_op": op, "hlo_module": module}}


def test_gpu_trace_counts_stream_kernels_once_and_tables_add_up(tmp_path):
    hlo = tr.parse_hlo(HLO)
    path = _trace(tmp_path, [
        _ev(7, "loop_fusion_kernel", "fusion.1", 300.0), _ev(7, "loop_fusion_kernel", "fusion.1", 100.0),
        _ev(7, "nvjet_gemm", "dot.5", 200.0), _ev(7, "ncclAllReduce", "all-reduce-start.2", 50.0),
        _ev(9, "fusion.1", "fusion.1", 400.0),             # the derived XLA Ops line: the same time again
        _ev(2, "host thunk", "dot.5", 900.0, pid=2),       # host side
        _ev(7, "other_module", "dot.5", 700.0, module="jit_init"),
    ])
    assert tr.trace_file(tmp_path) == path
    events = tr.read_events(path, "jit_step", hlo)
    assert sorted(e.seconds for e in events) == pytest.approx([50e-6, 100e-6, 200e-6, 300e-6])
    ops = {(r["phase"], r["op"]): r for r in tr.by_op(events, hlo, LABELS, steps=2)}
    # the fusion's 400 us and the all-reduce of its result (no metadata: named after its operand), over 2 steps
    assert ops[("backward", "layers/mlp")]["seconds"] == pytest.approx(225e-6)
    assert ops[("backward", "layers/mlp")]["calls"] == 1.5
    assert ops[("decode", "layers/attention")]["seconds"] == pytest.approx(100e-6)
    kernels = tr.by_kernel(events, hlo, LABELS, steps=2)
    assert [k["kernel"] for k in kernels] == ["loop_fusion_kernel", "nvjet_gemm", "ncclAllReduce"]
    assert kernels[0]["op"] == "layers/mlp" and kernels[0]["phase"] == "backward"
    (ar,) = tr.by_collective(events, hlo, steps=2)
    assert ar["kind"] == "all-reduce" and ar["calls"] == 0.5
    sent = 2 * 3 / 4 * 8 * 4 * 4  # a ring all-reduce over 4 devices sends 2 (n-1)/n of the tensor
    assert ar["bytes_per_step"] == pytest.approx(sent / 2)
    assert ar["bandwidth_bytes_per_s"] == pytest.approx(sent / 50e-6)


def test_a_kernel_name_shared_by_two_ops_is_a_row_for_each(tmp_path):
    """One kernel name run by instructions of two IR ops or phases (Mosaic names every kernel alike) is split
    between them, not all charged to the first."""
    hlo = tr.parse_hlo(HLO)
    path = _trace(tmp_path, [_ev(7, "anonymous_kernel", "fusion.1", 300.0), _ev(7, "anonymous_kernel", "dot.5", 100.0),
                             _ev(7, "anonymous_kernel", "dot.5", 100.0)])
    kernels = tr.by_kernel(tr.read_events(path, "jit_step", hlo), hlo, LABELS, steps=1)
    assert [(k["kernel"], k["phase"], k["op"], k["calls"]) for k in kernels] == [
        ("anonymous_kernel", "backward", "layers/mlp", 1), ("anonymous_kernel", "decode", "layers/attention", 2)]
    assert [k["seconds"] for k in kernels] == pytest.approx([300e-6, 200e-6])


def test_cpu_trace_skips_loop_thunks_that_span_their_bodies(tmp_path):
    hlo = tr.parse_hlo(HLO)
    path = tmp_path / "perfetto_trace.json.gz"
    events = [{"ph": "M", "pid": 5, "name": "process_name", "args": {"name": "/host:CPU"}},
              _ev(11, "while.8", "while.8", 1000.0, pid=5), _ev(12, "dot.5", "dot.5", 400.0, pid=5)]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = tr.read_events(path, "jit_step", hlo)
    assert [(e.hlo_op, e.seconds) for e in got] == [("dot.5", pytest.approx(400e-6))]


# ---- a real profile ------------------------------------------------------------------------------------------

TINY = ["--set", "model.args.layers=1", "--set", "task.batch=2", "--set", "task.seq_len=16"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    from tessera.cli import main

    out = tmp_path_factory.mktemp("profile") / "run"
    assert main(["profile", "specs/llama_tiny.yaml", *TINY, "--steps", "2", "--out", str(out)]) == 0
    return json.loads((out / "manifest.json").read_text())


def test_profile_times_each_ir_op_of_the_train_step(profiled):
    rec = profiled["profile"]
    assert profiled["status"] == "completed" and profiled["command"] == "profile"
    assert rec["what"] == "train step (2 x 16 tokens)" and rec["steps"] == 2
    rows = {(r["phase"], r["op"]): r for r in rec["by_op"]}
    for key in [("forward", "layers/attention"), ("backward", "layers/attention"), ("forward", "layers/mlp"),
                ("backward", "layers/mlp"), ("forward", "embed/unembed"), ("optimizer", "optimizer")]:
        assert rows[key]["seconds"] > 0 and rows[key]["calls"] >= 1, key
    assert sum(r["seconds"] for r in rec["by_op"]) == pytest.approx(rec["op_seconds"])
    # most of the step's work lands on an IR op: counted in instructions run, which a loaded machine (CI runs
    # two workers on two cores) does not skew as it skews their times
    named = sum(r["calls"] for r in rec["by_op"] if not r["op"].startswith("(other"))
    assert named > 0.5 * sum(r["calls"] for r in rec["by_op"]), rec["by_op"]
    assert 0.5 * rec["op_seconds"] < sum(k["seconds"] for k in rec["by_kernel"]) <= rec["op_seconds"] * (1 + 1e-9)
    assert rec["plan_seconds"] is None and rec["by_collective"] == []  # one CPU device: no peak, no collectives


def test_profile_saves_the_trace_and_prints_the_tables(profiled, capsys):
    from pathlib import Path

    from tessera.run.profile import render

    assert Path(profiled["trace"]).name == "perfetto_trace.json.gz" and Path(profiled["trace"]).stat().st_size > 0
    record = profiled["profile"]
    # every row: which op leads on a loaded CPU is a matter of timing
    render(record, __import__("sys").stdout, top=len(record["by_op"]))
    out = capsys.readouterr().out
    assert "layers/attention" in out and "backward" in out and "kernel" in out
    # `top` bounds each table: two IR-op rows per kernel row, the header lines around them
    render(record, __import__("sys").stdout, top=1)
    lines = capsys.readouterr().out.splitlines()
    first, second = lines.index(next(l for l in lines if l.startswith("Graph IR op"))), lines.index(
        next(l for l in lines if l.startswith("kernel")))
    assert second - first - 2 == min(2, len(record["by_op"]))
    assert record["by_kernel"][0]["kernel"][:48] in lines[second + 1]
    k = record["by_kernel"][0]  # and its time a call, in microseconds
    assert "us/call" in lines[second] and f"{k['seconds'] / k['calls'] * 1e6:,.1f}" in lines[second + 1]


def test_profile_of_a_pinn_feeds_its_loss_entries(tmp_path):
    """A PINN trains on collocation points, not tokens: the profiled step gets random inputs of its loss entries'
    shapes (each set's points), and every table comes out (it ended in KeyError 'interior')."""
    from tessera.cli import main

    out = tmp_path / "run"
    small = ["--set", "model.args.width=8", "--set", "model.args.depth=2", "--set", "task.data.sets.interior.n=16",
             "--set", "task.data.sets.boundary.n=8", "--set", "numerics.default=fp32",
             "--set", "numerics.params=fp32"]  # fp64 would turn x64 on for the rest of the process
    assert main(["profile", "specs/pinn_kovasznay.yaml", *small, "--steps", "1", "--out", str(out)]) == 0
    record = json.loads((out / "manifest.json").read_text())["profile"]
    assert record["what"] == "train step (interior 16x2, boundary 8x2, boundary_target 8x3)"
    assert record["by_op"] and record["by_kernel"] and record["op_seconds"] > 0


def test_profile_refuses_a_bad_step_count(capsys):
    from tessera.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["profile", "specs/llama_tiny.yaml", "--steps", "0"])
    assert exc.value.code == 2 and "positive integer" in capsys.readouterr().err


def test_plan_per_op_decode_times_add_up_to_the_plans_decode_step():
    """Batch-1 decode is bandwidth bound: the ops' bytes over the bandwidth sum to the plan's step time, each
    new token after the first one step."""
    from tessera.lower.program import program_graph
    from tessera.run.plan import DEVICES, build_plan
    from tessera.run.profile import predicted
    from tessera.spec import load_experiment

    exp = load_experiment("specs/gpt_oss_tiny.yaml", overrides=["task.kind=generate", "task.prompts=[[1, 2, 3]]",
                                                                 "task.max_new_tokens=5"])
    plan = build_plan(exp, device="h100")
    times = predicted(exp, program_graph(exp), train=False, device=DEVICES["h100"])
    decode = sum(t for (phase, _), t in times.items() if phase == "decode")
    # ops that read no parameters (the residual adds) still take their FLOPs' time: a few parts in 1e6 here
    assert decode == pytest.approx(plan["device"]["step_time_s"] * 4, rel=1e-4)
    assert times[("decode", "layers/moe")] > times[("decode", "layers/attn_norm/rmsnorm")]
    assert {phase for phase, _ in times} == {"prefill", "decode"}


def test_a_kernel_in_a_cuda_graph_is_found_by_its_fusion_name(tmp_path):
    hlo = tr.parse_hlo(HLO.replace("%fusion.1 =", "%loop_tanh_fusion.1 =").replace("(%fusion.1)", "(%loop_tanh_fusion.1)"))
    path = _trace(tmp_path, [_ev(7, "loop_tanh_fusion_1", "command_buffer_2", 80.0),
                             _ev(7, "nvjet_gemm", "command_buffer_2", 20.0)])
    events = tr.read_events(path, "jit_step", hlo)
    assert [e.hlo_op for e in events] == ["loop_tanh_fusion.1", "command_buffer_2"]
    ops = {(r["phase"], r["op"]): r["seconds"] for r in tr.by_op(events, hlo, LABELS, steps=1)}
    assert ops == {("backward", "layers/mlp"): pytest.approx(80e-6), ("forward", "(other)"): pytest.approx(20e-6)}


GEMMS = """HloModule jit_gen, entry_computation_layout={()->()}

ENTRY %main.1 (Arg_0.1: bf16[8,8], Arg_1.2: bf16[8,8]) -> bf16[1,8] {
  %Arg_0.1 = bf16[8,8]{1,0} parameter(0), metadata={op_name="params[\\'layers/attention/o\\'][0]"}
  %x.2 = bf16[1,8]{1,0} fusion(%Arg_0.1), kind=kLoop, calls=%f, metadata={op_name="jit(gen)/decode/layers/attention/mul"}
  %bitcast.3 = bf16[8,8]{0,1} bitcast(%Arg_0.1)
  %custom-call.4 = (bf16[1,8]{1,0}, s8[64]{0}) custom-call(%x.2, %bitcast.3), custom_call_target="__cublas$gemm"
  %gte.5 = bf16[1,8]{1,0} get-tuple-element(%custom-call.4), index=0
  ROOT %add.6 = bf16[1,8]{1,0} add(%gte.5, %x.2), metadata={op_name="jit(gen)/decode/layers/add.2/add"}
}
"""


def test_a_gemm_without_metadata_takes_its_phase_from_its_neighbours_and_its_op_from_its_weight():
    ops = tr.parse_hlo(GEMMS)
    gemm = ops["custom-call.4"]
    assert gemm.inherited and gemm.op_name == "jit(gen)/decode/layers/attention/mul"  # the operand's (gte: plumbing)
    assert "layers/attention/o" in gemm.weight
    labels = sorted(LABELS + ["layers/add.2"], key=len, reverse=True)
    owners = {"layers/attention/o": "layers/attention"}
    assert tr.op_label(gemm, labels, owners) == ("decode", "layers/attention")
    assert tr.op_label(ops["Arg_0.1"], labels, owners) == ("forward", "layers/attention")  # the weight itself
    assert tr.op_label(ops["add.6"], labels, owners) == ("decode", "layers/add.2")
