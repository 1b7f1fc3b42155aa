"""The program runs the compiler's one pipeline: what `tessera ir --after shard` prints is what is lowered.

A Llama written in primitive ops (dot, mask, softmax, ...) compiles to the same program as the composite
one, since `fuse` is in the pipeline compile runs; and parameters are placed by the graph's shard
annotations, so editing one in the IR text moves the parameter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tessera.ir.parser import parse_graph
from tessera.ir.printer import print_graph
from tessera.lower.options import CompileOptions
from tessera.lower.program import compile_experiment, program_graph
from tessera.lower.shard.step import make_plan
from tessera.spec import load_experiment
from tests.lower.shard.make_snapshots import ROOT

LLAMA = ROOT / "specs" / "llama_tiny.yaml"
PRIMITIVE = ROOT / "tests" / "data" / "ir" / "llama_primitive.tsl"


def test_primitive_llama_compiles_to_the_composite_program():
    jaxprs = []
    for over in ({}, {"model.file": str(PRIMITIVE)}):
        prog = compile_experiment(load_experiment(LLAMA, overrides=over))
        params = prog.init(0)
        jaxprs.append(str(jax.make_jaxpr(prog.forward)(params, jnp.zeros((2, 8), jnp.int32))))
    assert jaxprs[1] == jaxprs[0]


def _edited(exp, path: str, old: str, new: str):
    """exp's program graph printed, `path`'s annotation `old` replaced by `new`, and parsed back."""
    lines = print_graph(program_graph(exp)).splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(f"  param @{path} :"))
    assert f"| {old} =" in lines[i]
    lines[i] = lines[i].replace(f"| {old} =", f"| {new} =")
    return parse_graph("\n".join(lines) + "\n")


def test_an_edited_shard_annotation_moves_the_parameter():
    exp = load_experiment(LLAMA, overrides={"mesh.fsdp": 2, "mesh.tp": 2, "parallel.deterministic": False})
    devices = jax.devices()[:1] * 4  # placement only: nothing runs on this mesh
    plan = make_plan(CompileOptions.of(exp), program_graph(exp), devices=devices)
    assert tuple(plan.param_specs["embed/table"]) == ("tp", "fsdp")
    edited = make_plan(CompileOptions.of(exp), _edited(exp, "embed/table", "[tp, fsdp]", "[tp, -]"), devices=devices)
    assert tuple(edited.param_specs["embed/table"]) == ("tp", None)  # the ZeRO split undone: held whole
    assert dict(edited.env.param_axes)["embed/table"] == (("tp",), ())  # and gathered by what it is
    assert {k: v for k, v in edited.param_specs.items() if k != "embed/table"} == \
        {k: v for k, v in plan.param_specs.items() if k != "embed/table"}


def test_an_annotation_activations_disagree_with_is_refused():
    """Heads are split by tp in the activations too (the attention computes on its heads): a q annotated
    otherwise cannot run, and says why."""
    exp = load_experiment(LLAMA, overrides={"mesh.fsdp": 2, "mesh.tp": 2, "parallel.deterministic": False})
    graph = _edited(exp, "layers/attention/q", "[-, fsdp, tp, -]", "[-, fsdp, -, -]")
    with pytest.raises(ValueError, match=r"@layers/attention/q: `heads` is annotated `-`, but activations split "
                                         r"`heads` by `tp`"):
        make_plan(CompileOptions.of(exp), graph, devices=jax.devices()[:1] * 4)


def test_program_functions_lower_before_any_call_and_an_unknown_one_is_named():
    prog = compile_experiment(load_experiment(LLAMA))
    params = prog.param_shapes()
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    text = prog.lower("forward", params, tokens).as_text()
    assert "stablehlo" in text and "tensor<2x8xi32>" in text
    with pytest.raises(KeyError, match="lower one of \\['forward', 'loss', 'train_step'\\]"):
        prog.lower(("generate", 4), params, tokens)
