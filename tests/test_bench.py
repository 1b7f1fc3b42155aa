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
    from bench.timing import rotating_program

    many, args = rotating_program(lambda w, x: w * x, (jnp.float32(3.0),), [jnp.arange(4.0) + i for i in range(5)])
    outs = many(*args)
    assert len(outs) == 5
    for i, out in enumerate(outs):
        assert out.tolist() == [3.0 * (v + i) for v in range(4)]


def test_timing_a_function_again_compiles_nothing():
    """Rounds of timing (record_rounds) reuse the first round's programs, and a program traces
    its function once however many calls it makes: on a GPU a Mosaic attention variant took
    ~50 s to compile into the timing programs, its timing well under a second."""
    import jax.numpy as jnp
    from bench.timing import time_in_program

    traces = []

    def fn(x):
        traces.append(x.shape)
        return x * 2.0

    x = jnp.arange(8.0)
    assert time_in_program(fn, x, calls=(2, 4), reps=2) >= 0.0
    assert len(traces) == 1  # one trace for the 6 calls of both programs (2 calls and 4)
    time_in_program(fn, x, calls=(2, 4), reps=2)
    assert len(traces) == 1
    time_in_program(fn, jnp.arange(16.0), calls=(2, 4), reps=2)  # new shapes: traced anew
    assert len(traces) == 2


def test_the_long_program_keeps_its_length_across_rounds():
    """The call count of time_jax's long program follows the first timing of a function on given
    arguments, not each round's jitter (1.26 ms wants 32 extra calls, 1.30 ms 31: another program
    to compile); other arguments or another function get their own."""
    import jax.numpy as jnp
    from bench.timing import _extra_calls

    fn = lambda x: x + 1.0  # noqa: E731
    x = jnp.zeros(8)
    assert _extra_calls(fn, (x,), 1.26) == 32
    assert _extra_calls(fn, (x,), 1.30) == 32
    assert _extra_calls(fn, (jnp.zeros(16),), 1.30) == 31
    assert _extra_calls(lambda x: x * 2.0, (x,), 0.1) == 48


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


def _scope(tid, name, begin_cycles, end_cycles, start_us=1000.0):
    """A scope of the on-device profiler: ts is start time in us plus cycles / 1000."""
    return [{"name": name, "ph": "B", "ts": start_us + begin_cycles / 1e3, "tid": tid, "pid": 1},
            {"name": name, "ph": "E", "ts": start_us + end_cycles / 1e3, "tid": tid, "pid": 1}]


def test_profile_summary_counts_cycles_per_phase_and_the_gaps_between_phases():
    from bench import profile
    per_cta = 3  # tid 1 + index over the grid: CTA 0 holds tids 1, 2, 3; CTA 1 tids 4, 5, 6
    events = []
    for tid in (1, 2, 4, 5):  # the compute warpgroups of 2 CTAs
        events += _scope(tid, "qk", 0, 100) + _scope(tid, "softmax", 120, 520)
        events += _scope(tid, "qk", 600, 700) + _scope(tid, "softmax", 700, 1300)
    events += [{"name": "inner", "ph": "B", "ts": 1000.2, "tid": 1, "pid": 1},
               {"name": "inner", "ph": "E", "ts": 1000.25, "tid": 1, "pid": 1}]  # inside softmax
    events.sort(key=lambda e: (e["tid"], e["ts"], e["ph"] == "B"))
    events += _scope(3, "memory", 0, 9000)  # the memory warpgroup: not a role asked for
    s = profile.summarize(events, per_cta=per_cta, roles=(0, 1))
    assert s.warpgroups == 4 and s.span == pytest.approx(1300)
    assert list(s.phases)[:2] == ["softmax", "qk"] and "memory" not in s.phases
    assert s.phases["softmax"].cycles == pytest.approx(1000) and s.phases["softmax"].count == 2
    assert s.phases["qk"].cycles == pytest.approx(200)
    assert s.phases["qk"].percentiles == pytest.approx((100, 100, 100))
    assert s.phases["inner"].count == pytest.approx(0.25) and s.phases["inner"].cycles == pytest.approx(12.5)
    # gaps between top-level scopes only: qk -> softmax (20, then 0), softmax -> qk (80)
    assert s.gaps[("qk", "softmax")].cycles == pytest.approx(20)
    assert s.gaps[("softmax", "qk")].cycles == pytest.approx(80) and s.gaps[("softmax", "qk")].count == 1


def test_profile_summary_rejects_crossed_scopes():
    from bench import profile
    events = [{"name": "a", "ph": "B", "ts": 0.0, "tid": 1}, {"name": "b", "ph": "B", "ts": 0.1, "tid": 1},
              {"name": "a", "ph": "E", "ts": 0.2, "tid": 1}, {"name": "b", "ph": "E", "ts": 0.3, "tid": 1}]
    with pytest.raises(ValueError, match="'b' closed by 'a'"):
        profile.summarize(events, per_cta=3, roles=(0,))


def test_profiling_context_sets_the_profiler_of_kernels_traced_inside(monkeypatch):
    from tessera.lower.kernels import _mgpu
    seen = []
    monkeypatch.setattr(_mgpu.plgpu, "kernel", lambda body, **kw: seen.append(kw) or body)
    _mgpu.kernel_call(None, interpret=False)
    with _mgpu.profiling("/tmp/traces", 64):
        _mgpu.kernel_call(None, interpret=False)
        _mgpu.kernel_call(None, interpret=True)
    _mgpu.kernel_call(None, interpret=False)
    plain, profiled, interpreted, after = seen
    assert plain["compiler_params"].profile_space == 0 and plain["compiler_params"].approx_math
    assert (profiled["compiler_params"].profile_dir, profiled["compiler_params"].profile_space) == ("/tmp/traces", 64)
    assert profiled["compiler_params"].approx_math
    assert "compiler_params" not in interpreted and "interpret" in interpreted
    assert after["compiler_params"].profile_space == 0


def test_variants_are_timed_in_turns_and_keep_their_median(monkeypatch, capsys):
    from bench import timing

    monkeypatch.setattr(timing, "ROWS", [])
    calls = []

    def timer(name, times):
        it = iter(times)

        def run():
            calls.append(name)
            return next(it)
        return run

    def broken():
        calls.append("broken")
        raise RuntimeError("no such tile")

    timing.record_rounds("tune fwd x", [("tessera a", timer("a", [2.0, 1.0, 4.0])), ("tessera broken", broken),
                                        ("tessera b", timer("b", [1.0, 3.0, 2.0]))], 4e9, rounds=3)
    # in turns, odd rounds in reverse; a failing variant is dropped at once
    assert calls == ["a", "broken", "b", "b", "a", "a", "b"]
    assert [(r[1], r[2]) for r in timing.ROWS] == [("tessera a", 2.0), ("tessera b", 2.0)]
    assert timing.ROWS[0][3] == pytest.approx(2.0)  # 4e9 FLOP in 2 ms: 2 TFLOP/s
    out = capsys.readouterr().out
    assert "tune fwd x / tessera broken: failed: RuntimeError: no such tile" in out
    assert "(1.000-4.000 over 3 rounds)" in out and "(1.000-3.000 over 3 rounds)" in out


PROV = {"device": "NVIDIA H100 80GB HBM3", "jax": "0.11.2", "commit": "475d361"}


def test_results_write_one_table_per_suite_each_row_naming_device_jax_and_commit(tmp_path):
    from bench import results

    kernel = results.kernel_rows([("attn fwd D64 causal", "tessera (mosaic gpu)", 1.25, 440.0, "TFLOP/s"),
                                  ("attn fwd D64 causal", "cuDNN (jax.nn.dpa)", 1.3, 400.0, "TFLOP/s"),
                                  ("attn fwd D64 causal", "torch SDPA", 1.28, 410.0, "TFLOP/s"),
                                  ("memory ceiling (copy)", "jnp copy", 0.0, 3001.0, "GB/s")], PROV)
    e2e = results.e2e_rows([
        {"row": "20b decode b8", "kind": "decode", "batch": 8, "decode_tok_s": 1600.0, "prefill_tok_s": 900.0,
         "first_token_s": 0.0131, "compile_s": 99.7, "roofline_tok_s": 3200.0, "roofline_share": 0.5,
         "peak_bytes": 15 * 2**30, "planned_bytes": 14 * 2**30, "peer": "SGLang 1 GPU b8: 1,351 tok/s",
         "peers": [{"peer": "transformers generate", "tokens_per_s": 800.0, "step_ms": 10.0, "first_token_s": 0.02}]},
        {"row": "llama-1b train", "kind": "train", "forward_ms": 38.3, "forward_mfu": 0.564, "train_step_ms": 200.0,
         "train_step_mfu": 0.3, "train_step_flops_per_token": 1e10, "peak_flops": 1e15, "peak_bytes": None,
         "planned_bytes": 2**30, "peer": "-",
         "peers": [{"peer": "torch.compile", "tokens_per_s": 24000.0, "step_ms": 250.0},
                   {"peer": "eager", "error": "OOM"}]},
        {"row": "20b-layers train", "kind": "train", "peer": "NeMo 28 %", "error": "XlaRuntimeError: out of memory"},
    ], PROV)
    out = tmp_path / "RESULTS.md"
    text = results.write(out, {"attention": kernel, "e2e": e2e}, note="Copied from\nthe notebook.")
    assert text == out.read_text() and text.startswith(results.HEADER + "\n> Copied from\n> the notebook.\n\n## ")
    tail = "| NVIDIA H100 80GB HBM3 | 0.11.2 | 475d361 |"
    lines = text.splitlines()
    assert "## Attention: flash_attention (bench/suites/attention.py)" in lines
    assert "| case | implementation | time | rate | vs best peer | device | jax | commit | note |" in lines
    assert f"| attn fwd D64 causal | tessera (mosaic gpu) | 1.250 ms | 440.0 TFLOP/s | 1.07x {tail}  |" in lines
    assert f"| attn fwd D64 causal | torch SDPA | 1.280 ms | 410.0 TFLOP/s |  {tail}  |" in lines
    assert f"| memory ceiling (copy) | jnp copy | - | 3,001.0 GB/s |  {tail}  |" in lines
    assert (f"| 20b decode b8 | tessera run, decode | 5.000 ms | 1,600.0 tok/s | 2.00x {tail} 50% of the 3,200 "
            "tok/s roofline; prefill 900 tok/s; first token 13.1 ms; compile 99.7 s; peak 15.0 vs plan 14.0 GiB; "
            "published: SGLang 1 GPU b8: 1,351 tok/s |") in lines
    assert f"| 20b decode b8 | transformers generate | 10.000 ms | 800.0 tok/s |  {tail} first token 20.0 ms |" in lines
    assert f"| llama-1b train | tessera run, forward | 38.300 ms | 56.4 % MFU |  {tail} peak - vs plan 1.0 GiB |" \
        in lines
    assert f"| llama-1b train | tessera run, train step | 200.0 ms | 30.0 % MFU | 1.25x {tail}  |" in lines
    assert (f"| llama-1b train | torch.compile | 250.0 ms | 24.0 % MFU |  {tail} train step; MFU counted with "
            "Tessera's FLOPs |") in lines
    assert f"| llama-1b train | eager | - | - |  {tail} FAILED: OOM |" in lines
    assert (f"| 20b-layers train | tessera run | - | - |  {tail} FAILED: XlaRuntimeError: out of memory; "
            "published: NeMo 28 % |") in lines
    assert "## MoE grouped GEMM" not in text  # not measured, nothing to keep

    # a partial run rewrites the rows of the cases it ran and keeps the other rows, sections and the note,
    # and the sections written by hand (no suite's) after the suites
    hand = "## Scientific models: by hand\n\nA paragraph.\n\n| spec | error |\n|---|---|\n| pinn | 1e-3 |\n"
    out.write_text(text + "\n" + hand)
    b8 = dict(e2e[0], commit="abc1234", note="")
    again = results.write(out, {"e2e": [b8]})
    sections = results.sections_of(again)
    assert list(sections) == [results.TITLES["attention"], results.TITLES["e2e"], "Scientific models: by hand"]
    assert sections["Scientific models: by hand"] == hand
    assert sections[results.TITLES["attention"]] == results.sections_of(text)[results.TITLES["attention"]]
    e2e_lines = [line for line in sections[results.TITLES["e2e"]].splitlines() if line.startswith("| ")][1:]
    assert e2e_lines[0] == "| 20b decode b8 | tessera run, decode | 5.000 ms | 1,600.0 tok/s | 2.00x " \
        "| NVIDIA H100 80GB HBM3 | 0.11.2 | abc1234 |  |"
    assert [line.split(" | ")[1] for line in e2e_lines[1:]] == [
        "tessera run, forward", "tessera run, train step", "torch.compile", "eager", "tessera run"]
    assert results.note_of(again) == "Copied from\nthe notebook."
    # once every row is new, the note goes
    final = results.write(out, {"attention": kernel, "e2e": e2e})
    assert results.note_of(final) == "" and final.startswith(results.HEADER + "\n## ")


def test_e2e_sets_each_variant_against_its_base_row_of_the_same_run():
    """A row whose name is another row's and more (fp8 of bf16, fp8 attention weights of bf16 decode) gets its speed
    against the longest such row of the same kind in the run; rows with no base, of another kind or failed get none;
    bench.results writes the ratio into the train step's or decode's note."""
    from bench import e2e, results

    rows = [{"row": "llama-1b train", "kind": "train", "train_step_ms": 250.0, "forward_ms": 70.0, "peer": "-"},
            {"row": "llama-1b train fp8", "kind": "train", "train_step_ms": 200.0, "peer": "-"},
            {"row": "llama-1b train fp8 delayed", "kind": "train", "train_step_ms": 160.0, "peer": "-"},
            {"row": "20b decode b1", "kind": "decode", "decode_tok_s": 400.0, "peer": "-"},
            {"row": "20b decode b1 fp8 attn", "kind": "decode", "decode_tok_s": 404.0, "batch": 1, "peer": "-"},
            {"row": "20b decode b8", "kind": "decode", "decode_tok_s": 1600.0, "peer": "-"},
            {"row": "20b-layers train", "kind": "train", "error": "out of memory", "peer": "-"},
            {"row": "20b-layers train deterministic", "kind": "train", "train_step_ms": 130.0, "peer": "-"}]
    lines = e2e.against_base(rows)
    assert lines == ["# llama-1b train fp8: train step 1.250x the speed of llama-1b train",
                     "# llama-1b train fp8 delayed: train step 1.250x the speed of llama-1b train fp8",
                     "# 20b decode b1 fp8 attn: decode 1.010x the speed of 20b decode b1"]
    assert rows[2]["vs_base"] == {"row": "llama-1b train fp8", "speedup": 1.25}
    assert [r["row"] for r in rows if "vs_base" in r] == ["llama-1b train fp8", "llama-1b train fp8 delayed",
                                                          "20b decode b1 fp8 attn"]
    table = results.e2e_rows([rows[1], rows[4]], PROV)
    assert table[0]["impl"] == "tessera run, train step" and \
        table[0]["note"] == "1.250x the speed of llama-1b train (same run)"
    assert "1.010x the speed of 20b decode b1 (same run)" in table[1]["note"]


def test_results_commit_is_the_short_hash_and_says_dirty(tmp_path, monkeypatch):
    import subprocess

    from bench import results

    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    assert results.commit(tmp_path) == "unknown"  # not a checkout

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "a.txt").write_text("1")
    subprocess.run(git + ["add", "a.txt"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "a"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True)
    assert results.commit(tmp_path) == head.stdout.strip()
    (tmp_path / "new.txt").write_text("untracked files leave it clean")
    assert results.commit(tmp_path) == head.stdout.strip()
    (tmp_path / "a.txt").write_text("2")
    assert results.commit(tmp_path) == head.stdout.strip() + "+dirty"
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")  # a copied tree whose .git is not its own
    assert results.commit(tmp_path) == "abc1234"


def test_scaling_configurations_never_share_a_run_directory():
    """bench/scaling.py names each configuration's run directory after its overrides, cut for the path: two that
    differ only past the cut (a deterministic and a fast run of one mesh with long overrides) stay apart."""
    from bench.scaling import run_tag

    base = ["task.steps=20", "task.eval_every=0", "checkpoint.every=0", "parallel.canonical_tp=2",
            "parallel.canonical_ep=2", "mesh.tp=2", "mesh.ep=2"]
    det, fast = (run_tag("specs/gpt_oss_tiny.yaml", base + [f"parallel.deterministic={m}"]) for m in ("true", "false"))
    assert det != fast and len(det) < 120 and det.startswith("gpt_oss_tiny-task_steps20")
    assert run_tag("specs/x.yaml", ["mesh.dp=2"]) == "x-mesh_dp2"
    assert run_tag("specs/x.yaml", [], attempt=2) == "x-base-again2"


def test_across_commits_exports_a_commits_own_trees(tmp_path):
    """`bench.across_commits export` writes the commit's tessera/, specs/ and models/ as that commit holds them (git
    archive: a file edited since is the commit's there), and ORDER lists what it wrote."""
    import subprocess

    from bench import across_commits

    root = across_commits.ROOT
    (tree,) = across_commits.export(["HEAD"], store=tmp_path)
    assert (tmp_path / "ORDER").read_text().split() == [tree.name]
    assert (tree / "specs" / "llama_tiny.yaml").is_file() and (tree / "models" / "llama.tsl").is_file()
    assert not (tree / "tests").exists()
    head = subprocess.run(["git", "show", "HEAD:tessera/cli.py"], cwd=root, capture_output=True, text=True,
                          check=True).stdout
    assert (tree / "tessera" / "cli.py").read_text() == head


def test_every_e2e_row_is_a_valid_spec():
    """Each `bench.e2e` row's spec with its overrides passes validation (a typo fails here, not on a GPU), and the
    two rows of a pair the issue compares (fp8 against bf16) differ in their numeric policy only."""
    from bench import e2e
    from tessera.spec import load_experiment

    exps = {name: load_experiment(spec, overrides=overrides) for name, (_, spec, overrides, _) in e2e.ROWS.items()}
    for fp8, bf16 in (("llama-1b train fp8", "llama-1b train"), ("llama-8b-layers train fp8", "llama-8b-layers train"),
                      ("llama-1b train fp8 deterministic", "llama-1b train deterministic"),
                      ("llama-1b train fp8 unembedding", "llama-1b train"),
                      ("llama-1b train fp8 delayed unembedding", "llama-1b train"),
                      ("llama-8b-layers train fp8 delayed unembedding", "llama-8b-layers train")):
        a, b = exps[fp8].model_dump(), exps[bf16].model_dump()
        assert a.pop("numerics")["default"] != b.pop("numerics")["default"]
        assert a == b
    from tessera.ir.check import check_experiment
    from tessera.ir.passes.numerics import fp8_ops_of

    for row, label in (("llama-1b train fp8 unembedding", "embed/unembed"),  # tied: the table's directory
                       ("llama-1b train fp8 delayed unembedding", "embed/unembed"),
                       ("llama-8b-layers train fp8 delayed unembedding", "unembed")):
        assert fp8_ops_of(check_experiment(exps[row]).attrs) == {label: True}


def test_e2e_sets_override_every_row_after_its_own():
    """`bench.e2e --set` reaches each row's spec after the row's overrides: a row's policy survives its JSON round
    trip, and the set's key takes the set's value."""
    from bench import e2e
    from tessera.spec import load_experiment

    name = "llama-1b train fp8 delayed unembedding"
    _, spec, overrides, _ = e2e.ROWS[name]
    got = load_experiment(spec, overrides=e2e.row_overrides(name, ["parallel.remat=none"])).model_dump()
    want = load_experiment(spec, overrides={**overrides, "parallel.remat": "none"}).model_dump()
    assert got == want and got["parallel"]["remat"] == "none"
    assert list(got["numerics"]["compute"]) == ["*unembed"]
