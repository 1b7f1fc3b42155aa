"""CompileOptions: the spec read once, typed; the lowering runs from it without the experiment, and the
modules of tessera/lower and tessera/run call each other through public names only."""

from __future__ import annotations

import ast
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.options import CompileOptions
from tessera.lower.program import Program, compile_experiment
from tessera.run.optim import build_optimizer
from tessera.spec import load_experiment
from tessera.spec.schema import Experiment

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "specs" / "llama_tiny.yaml"
SMALL = {"model.args.layers": 1, "model.args.d_model": 32, "model.args.heads": 2, "model.args.kv_heads": 1,
         "model.args.head_dim": 16, "model.args.d_ff": 32, "model.args.vocab": 64, "task.batch": 2,
         "task.seq_len": 8, "task.steps": 2}


def test_options_take_the_spec_values_with_the_schema_defaults():
    exp = load_experiment(LLAMA, overrides={**SMALL, "mesh.dp": 2, "parallel.remat": "dots",
                                            "task.microbatches": 2, "task.batch": 4})
    opts = CompileOptions.of(exp)
    assert opts.kernels == Experiment.model_fields["kernels"].default == "auto"  # the schema's, not a guess
    assert opts.mesh_size == 2 and dict(opts.mesh_axes) == dict(exp.mesh.axes) and opts.pp == 1
    assert opts.rules.axes("batch") == ("dp",)
    assert (opts.remat, opts.deterministic, opts.pipeline_schedule) == ("dots", True, "gpipe")
    assert (opts.task_kind, opts.trains, opts.batch, opts.seq_len, opts.grad_accumulation) == ("train", True, 4, 8, 2)
    assert dict(opts.task_sizes) == {"batch": 4, "seq": 8}
    assert opts.model_file == Path(exp.model.file) and opts.model_args["vocab"] == 64
    assert opts.span("mesh.dp") == exp.span("mesh.dp") and opts.span("mesh.dp") is not None
    with pytest.raises(Exception):
        opts.remat = "full"  # frozen


def test_a_program_runs_from_its_options_alone():
    """Nothing below compile_experiment reads the experiment: a Program made without one trains and generates."""
    exp = load_experiment(LLAMA, overrides=SMALL)
    prog = compile_experiment(exp, optimizer=build_optimizer(exp))
    bare = Program(prog.options, prog.graph, ir_hash=prog.ir_hash, optimizer=prog.optimizer, plan=prog.plan)
    assert bare.exp is None and prog.exp is exp
    tokens = jnp.asarray(np.arange(16).reshape(2, 8) % 64, jnp.int32)
    batch = {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1), "mask": jnp.ones((2, 8), jnp.float32)}
    state, metrics = bare.train_step(bare.init_train_state(bare.init(0)), batch)  # the state is donated
    assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1
    assert bare.generate(state.params, tokens[:, :3], max_new_tokens=2).shape == (2, 5)
    assert bare.flops_per_token()["forward"] > 0


def _private_uses(path: Path) -> list[str]:
    """`module._name` / `from module import _name` of another module's private name (self._x is the module's own)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tessera"):
            out += [f"from {node.module} import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(ast.unparse(node))
    return out


@pytest.mark.parametrize("package", ["lower", "run"])
def test_modules_call_each_other_through_public_names(package):
    """The step builders, pipelines, plan and tasks use the program's public pieces, not its private methods
    (the Pallas kernels share their private helpers in lower/kernels, which is left out)."""
    found = {str(p.relative_to(ROOT)): uses for p in sorted((ROOT / "tessera" / package).rglob("*.py"))
             if "kernels" not in p.parts and (uses := _private_uses(p))}
    assert found == {}
