"""Sharding rules, the `shard` pass, golden snapshots and the mesh errors (one device: no subprocess)."""

from __future__ import annotations

import pytest

from tessera.diagnostics import TesseraError
from tessera.ir.parser import parse_graph
from tessera.ir.passes import PassContext, run_pass
from tessera.lower.options import CompileOptions
from tessera.lower.program import program_graph
from tessera.lower.shard.mesh import build_mesh
from tessera.lower.shard.rules import AxisRules, partition_spec
from tessera.spec import load_experiment
from tests.lower.shard.make_snapshots import OUT, ROOT, cases, render, snapshot

SPEC = ROOT / "specs" / "gpt_oss_tiny.yaml"


def _exp(**over):
    return load_experiment(SPEC, overrides={k.replace("__", "."): v for k, v in over.items()})


def _refusal(spec, over: dict) -> list:
    """`tessera check`'s diagnostics for `spec` with `over`, which it must refuse."""
    from tessera.ir.check import check_experiment

    with pytest.raises(TesseraError) as e:
        check_experiment(load_experiment(spec, overrides=over))
    return e.value.diagnostics


def test_rules_drop_size_one_axes_and_give_batch_priority():
    rules = AxisRules.from_experiment(_exp(mesh__fsdp=2, mesh__tp=2, mesh__dp=2))
    assert rules.axes("batch") == ("dp", "fsdp") and rules.axes("experts") == ()  # ep=1 splits nothing
    assert rules.dims(("batch", "seq", "embed"), activation=True) == (("dp", "fsdp"), (), ())
    assert rules.dims(("layers", "embed", "heads", "head_dim")) == ((), ("fsdp",), ("tp",), ())
    assert partition_spec(rules, ("embed", "vocab")) == partition_spec(rules, ("embed", "vocab"))
    assert tuple(partition_spec(rules, ("batch", "seq"), activation=True)) == (("dp", "fsdp"), None)


def test_sequence_parallel_splits_activation_seq_over_tp():
    rules = AxisRules.from_experiment(_exp(mesh__tp=2, parallel__sequence_parallel=True))
    assert rules.dims(("batch", "seq", "embed"), activation=True) == ((), ("tp",), ())
    assert rules.dims(("batch", "seq", "heads", "head_dim"), activation=True) == ((), (), ("tp",), ())


def test_shard_pass_annotates_every_value_and_round_trips():
    exp = _exp(mesh__tp=2, mesh__dp=2, mesh__fsdp=2)
    graph = run_pass("shard", program_graph(exp), PassContext.of(exp))
    text = str(graph)
    assert "param @layers/attention/q : f32[layers=2, embed=128, heads=4, head_dim=32] | [-, fsdp, tp, -]" in text
    assert "input %tokens : i32[batch, seq] | [dp*fsdp, -]" in text
    for op in graph.body.walk():
        for v in op.results:
            assert v.type.shard is not None and len(v.type.shard) == len(v.type.dims), op.name
    assert str(parse_graph(text)) == text


def test_shard_pass_is_in_the_pipeline():
    from tessera.ir.passes import PIPELINE

    assert PIPELINE[-1] == "shard"


@pytest.mark.parametrize("name,spec,mesh", cases(), ids=[c[0] for c in cases()])
def test_golden_sharding_snapshot(name, spec, mesh):
    assert render(snapshot(spec, mesh)) == (OUT / name).read_text(), \
        f"{name} changed: rerun python -m tests.lower.shard.make_snapshots and review the diff"


def test_snapshot_local_shapes_divide():
    snap = snapshot("gpt_oss_120b", {"mesh.fsdp": 2, "mesh.tp": 2, "mesh.ep": 2})
    q = snap["params"]["layers/attention/q"]
    assert q == {"axes": ["layers", "embed", "heads", "head_dim"], "mesh": [None, "fsdp", "tp", None],
                 "shape": [36, 2880, 64, 64], "local_shape": [36, 1440, 32, 64]}
    assert snap["params"]["layers/moe/experts/gate"]["local_shape"] == [36, 64, 1440, 1440]


def test_a_mesh_bigger_than_the_devices_is_refused_at_its_key():
    exp = _exp(mesh__tp=2, mesh__dp=4)
    graph = program_graph(exp)
    with pytest.raises(TesseraError) as e:
        build_mesh(CompileOptions.of(exp), graph.params, devices=[object()] * 4)
    d = e.value.diagnostics[0]
    assert "the mesh has 8 devices (dp=4 × tp=2) but 4 are available" in d.message
    assert d.key == "mesh.dp" and d.span is not None and d.span.line >= 1
    assert "at most 4" in d.hint


def test_a_smaller_mesh_takes_the_first_devices():
    exp = _exp(mesh__tp=2, mesh__dp=2)
    graph = program_graph(exp)
    devices = [object() for _ in range(8)]
    mesh = build_mesh(CompileOptions.of(exp), graph.params, devices=devices)
    assert {a: n for a, n in mesh.shape.items() if n > 1} == {"dp": 2, "tp": 2}
    assert list(mesh.devices.flat) == devices[:4]


def test_several_processes_must_use_every_device():
    from tessera.lower.shard.mesh import check_devices

    options = CompileOptions.of(_exp(mesh__tp=2, mesh__dp=2))
    d, = check_devices(options, 8, processes=2)
    assert "8 are available over 2 processes, which must all take part" in d.message and "dp=8" in d.hint
    assert check_devices(options, 8) == [] and check_devices(options, 4, processes=2) == []


def test_axis_that_does_not_divide_a_parameter_dim_names_it():
    # the spec's own checks know the model arguments; the mesh check covers every parameter dim a rule splits
    # (one check: compiling runs it first, and building the mesh of an unchecked graph runs it again)
    from tessera.ir.check import experiment_graph

    exp = _exp(mesh__ep=4, model__args__head_dim=30, parallel__rules__head_dim="ep")
    for fails in (lambda: program_graph(exp),
                  lambda: build_mesh(CompileOptions.of(exp), experiment_graph(exp).params, devices=[object()] * 4)):
        with pytest.raises(TesseraError) as e:
            fails()
        msgs = [d.message for d in e.value.diagnostics]
        assert any("ep=4 does not divide `head_dim` = 30 (param `layers/attention/q`)" in m for m in msgs)
        d = e.value.diagnostics[0]
        assert d.key == "mesh.ep" and d.hint.endswith("divides 30: 1, 2, 3, 5, 6, 10 ...")


def test_pipeline_stages_must_start_on_the_layer_pattern():
    from tessera.lower.shard.pipeline import check_stages

    exp = _exp(mesh__pp=2, mesh__dp=1, parallel__deterministic=False)  # 2 layers, window on even ones only
    with pytest.raises(TesseraError) as e:
        check_stages(CompileOptions.of(exp), program_graph(exp))
    d = e.value.diagnostics[0]
    assert "pp=2 gives stages of 1 layer(s), but the layers' attributes repeat every 2 layers" in d.message
    assert d.key == "mesh.pp" and d.span is not None
    ok = _exp(mesh__pp=2, model__args__layers=4, parallel__deterministic=False)
    check_stages(CompileOptions.of(ok), program_graph(ok))


def test_fast_mode_refuses_context_parallelism_over_an_axis_that_splits_heads():
    from tessera.lower.shard.step import make_plan

    exp = _exp(mesh__tp=2, parallel__rules__seq="tp", parallel__deterministic=False)
    import jax
    with pytest.raises(TesseraError, match="context parallelism over `tp` is not supported") as e:
        make_plan(CompileOptions.of(exp), program_graph(exp), devices=jax.devices()[:1] * 2)
    assert e.value.diagnostics[0].key == "parallel.rules.seq" and e.value.diagnostics[0].span is not None


def test_deterministic_batch_must_split_into_canonical_shards_over_the_mesh():
    from tessera.lower.shard.deterministic import canonical_shards, check_canonical, tree_sum
    import numpy as np

    assert [canonical_shards(b) for b in (16, 8, 12, 6, 7)] == [8, 8, 6, 6, 7]
    check_canonical(CompileOptions.of(_exp()), 16, 8)
    with pytest.raises(TesseraError) as e:
        check_canonical(CompileOptions.of(_exp()), 12, 4)  # 6 canonical shards over 4 devices
    d = e.value.diagnostics[0]
    assert "cuts the batch of 12 into 6 canonical shards, which do not split over 4 devices" in d.message
    assert d.key == "task.batch" and d.span is not None
    x = np.asarray([1e8, 1.0, -1e8, 1.0, 3.0], np.float32)
    assert float(tree_sum(x)) == float(((x[0] + x[1]) + (x[2] + x[3])) + x[4])


def test_canonical_tp_must_cut_every_head_and_hidden_dim_and_refuses_fp8():
    """parallel.canonical_tp (deterministic tp, tessera/lower/shard/det_tensor.py) is refused at its key where a dim it
    cuts does not split into that many chunks (llama_tiny's 2 kv heads into 4), and with fp8 compute; 2 checks."""
    from tessera.ir.check import check_experiment

    spec = ROOT / "specs" / "llama_tiny.yaml"
    check_experiment(load_experiment(spec, overrides={"parallel.canonical_tp": 2, "mesh.tp": 2, "mesh.dp": 4}))
    check_experiment(load_experiment(spec, overrides={"parallel.canonical_tp": 4, "parallel.deterministic": False}))
    for over, message in [
        ({"parallel.canonical_tp": 4}, "does not divide layers/attention/k's kv_heads (2)"),
        ({"parallel.canonical_tp": 2, "numerics.default": "fp8_e4m3 @scale(per_tensor) @accum(fp32)"},
         "with fp8 compute")]:
        d = _refusal(spec, over)[0]
        assert message in d.message and d.key == "parallel.canonical_tp" and d.span is not None, d.message


def test_canonical_ep_must_cut_the_experts():
    """parallel.canonical_ep (deterministic ep, tessera/lower/shard/det_expert.py) is refused at its key where it does
    not divide the experts and with fp8 compute; beside canonical_tp it is accepted (both split the compute)."""
    from tessera.ir.check import check_experiment

    spec = ROOT / "specs" / "gpt_oss_tiny.yaml"
    check_experiment(load_experiment(spec, overrides={"parallel.canonical_ep": 2, "mesh.ep": 2, "mesh.dp": 4}))
    check_experiment(load_experiment(spec, overrides={"parallel.canonical_ep": 2, "parallel.canonical_tp": 2,
                                                      "mesh.ep": 2, "mesh.tp": 2, "mesh.dp": 2}))
    for over, message in [
        ({"parallel.canonical_ep": 3}, "does not divide layers/moe/router's experts"),
        ({"parallel.canonical_ep": 2, "numerics.default": "fp8_e4m3 @scale(per_tensor) @accum(fp32)"},
         "with fp8 compute")]:
        d = _refusal(spec, over)[0]
        assert message in d.message and d.key == "parallel.canonical_ep" and d.span is not None, d.message


def test_canonical_shards_set_in_the_spec_lift_the_cap_of_eight():
    """parallel.canonical_shards fixes C past the default's 8 (a mesh of 16 devices), is refused where it does not
    divide the batch (on one device too) or the mesh's device count does not divide it, at its own key."""
    from tessera.ir.check import check_experiment
    from tessera.lower.shard.deterministic import canonical_shards

    assert canonical_shards(32, 16) == 16 and canonical_shards(32) == 8
    spec = ROOT / "specs" / "gpt_oss_tiny.yaml"
    check_experiment(load_experiment(spec, overrides={"task.batch": 32, "parallel.canonical_shards": 16,
                                                      "mesh.dp": 16}))
    for over, message, hint in [
        ({"task.batch": 32, "parallel.canonical_shards": 12}, "parallel.canonical_shards = 12 does not divide the "
         "batch of 32", "use a divisor of 32"),
        ({"task.batch": 32, "parallel.canonical_shards": 8, "mesh.dp": 16}, "into 8 canonical shards "
         "(parallel.canonical_shards), which do not split over 16 devices", "use 16 (a multiple of 16 dividing"),
        ({"task.batch": 32, "mesh.dp": 16}, "into 8 canonical shards, which do not split over 16 devices",
         "set parallel.canonical_shards to a multiple of the device count")]:
        (d,) = _refusal(spec, over)
        assert message in d.message and hint in d.hint, (d.message, d.hint)
        assert d.key == ("task.batch" if "parallel.canonical_shards" not in over else "parallel.canonical_shards")
    # fast mode ignores it, as it ignores the canonical shards
    check_experiment(load_experiment(spec, overrides={"task.batch": 32, "parallel.canonical_shards": 12,
                                                      "parallel.deterministic": False}))


def test_check_refuses_a_batch_whose_canonical_shards_do_not_split_over_the_mesh():
    """`tessera check` applies the sharded step's rule before anything compiles (the run sweep found a spec that
    `check` accepted and `run` refused); fast mode and one device are not concerned."""
    from tessera.ir.check import check_experiment

    exp = load_experiment(ROOT / "specs" / "gpt_oss_tiny.yaml", overrides={"task.batch": 2, "mesh.sp": 2, "mesh.tp": 2})
    with pytest.raises(TesseraError) as e:
        check_experiment(exp)
    (d,) = e.value.diagnostics
    assert d.key == "task.batch" and d.span is not None and "into 2 canonical shards" in d.message
    check_experiment(load_experiment(ROOT / "specs" / "gpt_oss_tiny.yaml",
                                     overrides={"task.batch": 8, "mesh.sp": 2, "mesh.tp": 2}))
