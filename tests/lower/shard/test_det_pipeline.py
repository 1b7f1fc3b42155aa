"""When deterministic mode splits the layers' compute over pp stages (tessera/lower/shard/det_pipeline.py `plan`),
and the reason it gives where it does not (pp then acts as a data axis). From the graph alone: nothing compiles.
That the pipelined step gives one device's bits is checked end to end in test_train_meshes.py."""

from __future__ import annotations

import types

import pytest
from jax.sharding import PartitionSpec as P

from tessera.lower.program import program_graph
from tessera.lower.shard import det_pipeline
from tessera.spec import load_experiment
from tests.lower.shard.make_snapshots import ROOT


def _plan(spec: str, mesh: dict, c: int = 8, **over):
    graph = program_graph(load_experiment(ROOT / "specs" / spec, overrides=over))
    shapes = {p: types.SimpleNamespace(shape=tuple(d.size for d in v.type.dims)) for p, v in graph.params.items()}
    stacked = {p for p in graph.params if p.startswith("layers/")}
    specs = {p: (P("pp", "fsdp") if p in stacked else P("fsdp")) for p in graph.params}
    return det_pipeline.plan(graph, shapes, mesh, specs, c)


@pytest.mark.parametrize("numerics", ["bf16", "fp8_e4m3 @scale(per_tensor) @accum(fp32)",
                                      "fp8_e4m3 @scale(delayed) @accum(fp32)"])
def test_narrow_compute_takes_the_pipelined_step(numerics):
    layout, why = _plan("llama_tiny.yaml", {"pp": 2, "dp": 4}, **{"model.args.layers": 4, "numerics.default": numerics})
    assert why == "" and layout is not None


def test_llama_in_two_stages_of_two_layers_splits_and_knows_its_pieces():
    layout, why = _plan("llama_tiny.yaml", {"pp": 2, "fsdp": 2, "dp": 2}, **{"model.args.layers": 4})
    assert why == "" and layout.stages == 2 and layout.data_axes == ("fsdp", "dp")
    assert "embed/table" in layout.pre_reads & layout.post_reads  # the tied table: both ends read it
    assert all(p.startswith("layers/") for p in layout.stacked) and len(layout.stacked) > 5


@pytest.mark.parametrize("spec, mesh, c, over, why", [
    ("llama_tiny.yaml", {"pp": 1, "dp": 8}, 8, {}, "no pp axis"),
    ("llama_tiny.yaml", {"pp": 2, "dp": 4}, 8, {}, "stages of 1 layer(s) run the layers' scan 1 step(s)"),
    ("gpt_oss_tiny.yaml", {"pp": 2, "dp": 4}, 8, {"model.args.layers": 4},
     "stages of 2 layer(s) run the layers' scan 1 step(s)"),  # its attention windows alternate: a period of 2
    ("llama_tiny.yaml", {"pp": 2, "dp": 4}, 12, {"model.args.layers": 4}, "C = 12 over 4 data devices"),
    ("llama_tiny.yaml", {"pp": 2, "dp": 3}, 6, {"model.args.layers": 4}, "C = 6 over 3 data devices"),
])
def test_where_pp_stays_a_data_axis_it_says_why(spec, mesh, c, over, why):
    layout, reason = _plan(spec, mesh, c, **over)
    assert layout is None and reason.startswith(why), reason


def test_tp_splits_each_stages_layers_and_refuses_a_split_read_outside_them():
    """det_tensor.plan on a pp mesh whose stages split the layers: pp is no data axis of tp's step, and a parameter
    that tp's chunked ops read outside the layers (which the pipeline's ends compute whole) keeps tp a data axis."""
    import dataclasses

    from tessera.lower.shard import det_tensor

    graph = program_graph(load_experiment(ROOT / "specs" / "llama_tiny.yaml", overrides={"model.args.layers": 4}))
    dims = {p: tuple(d.size for d in v.type.dims) for p, v in graph.params.items()}
    shapes = {p: types.SimpleNamespace(shape=s) for p, s in dims.items()}
    split = {p for p, s in dims.items() if p.startswith("layers/") and ("/attention/" in p or "/mlp/" in p) and len(s) >= 3}
    specs = {p: (P("pp", *[None] * (len(s) - 2), "tp") if p in split else P("pp") if p.startswith("layers/") else P())
             for p, s in dims.items()}
    mesh = {"pp": 2, "tp": 2, "dp": 2}
    pipe, why = det_pipeline.plan(graph, shapes, mesh, specs, 8)
    assert why == "" and pipe.data_axes == ("tp", "dp")
    layout, whys = det_tensor.plan(graph, shapes, mesh, specs, 8, {"tp": 2}, pipe)
    assert whys == {"tp": ""} and layout.data_axes == ("dp",) and set(layout.chunked) == split
    assert all(layout.slice_of(p) == 2 for p in split)
    ends = dataclasses.replace(pipe, pre_reads=pipe.pre_reads | {sorted(split)[0]})
    layout, whys = det_tensor.plan(graph, shapes, mesh, specs, 8, {"tp": 2}, ends)
    assert layout is None and whys["tp"] == (f"{sorted(split)[0]} is read split outside the layers, which the "
                                             "pipeline's ends compute whole")
    layout, whys = det_tensor.plan(graph, shapes, mesh, specs, 8, {"tp": 2})  # no pipeline: pp is a data axis
    assert layout.data_axes == ("pp", "dp")
