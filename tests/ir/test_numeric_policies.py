"""Every numeric type of the grammar, with each modifier, as numerics.default, numerics.params, a rule and a
per-op compute rule, on a training and a generation task: `tessera check` refuses it with a positioned error, or
the program it passes lowers (traced at the task's shapes). Nothing parsed is silently ignored, and nothing fails in the lowering."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
import yaml

from tessera.cli import main
from tessera.diagnostics import TesseraError
from tessera.ir.check import check_experiment
from tessera.grammar.numerics import BASE_TYPES
from tessera.lower.options import CompileOptions
from tessera.lower.program import compile_experiment
from tessera.lower.sampling import SamplingRule
from tessera.lower.storage import check_packed
from tessera.run.optim import build_optimizer
from tessera.spec import load_experiment
from tests.lower.shard.make_snapshots import ROOT

SPEC = str(ROOT / "specs" / "gpt_oss_tiny.yaml")
MODIFIERS = ["", " @accum(fp32)", " @accum(bf16)", " @scale(per_tensor)", " @scale(per_block(32))",
             " @scale(delayed)", " @loss_scale(1024.0)", " @loss_scale(dynamic)"]
GENERATE = {"kind": "generate", "seed": 0, "prompts": [[1, 2, 3]], "max_new_tokens": 2}
RULE = "*/experts/gate"  # [experts, embed, mlp]: K = embed, whole 32-element groups for mxfp4


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> dict:
    """{task: spec path}: the tiny GPT-OSS as shipped (train), and resolved with a generate task instead."""
    spec = load_experiment(SPEC).resolved()
    spec["model"]["file"], spec["task"] = str(ROOT / "models" / "gpt_oss.tsl"), GENERATE
    path = tmp_path_factory.mktemp("numerics") / "generate.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return {"train": SPEC, "generate": str(path)}


def _overrides(numeric: str, where: str) -> dict:
    key = {"default": "numerics.default", "params": "numerics.params", "rule": "numerics.rules",
           "compute": "numerics.compute"}[where]
    value = {RULE: numeric} if where == "rule" else {"layers/moe": numeric} if where == "compute" else numeric
    # one layer: every op of the model still lowers, in half the tracing of two
    return {key: value, "model.args.layers": 1}


def _check(spec: str, over: dict) -> list:
    """`tessera check`'s checks (its cmd_check): the diagnostics of the refusal, or [] when it passes."""
    try:
        exp = load_experiment(spec, overrides=over)
        check_packed(CompileOptions.of(exp), check_experiment(exp))
    except TesseraError as e:
        return e.diagnostics
    return []


def _lowers(spec: str, over: dict, task: str) -> None:
    exp = load_experiment(spec, overrides=over)
    if task == "train":
        prog = compile_experiment(exp, optimizer=build_optimizer(exp))
        state = jax.eval_shape(prog.init_train_state, jax.eval_shape(lambda: prog.init(0)))
        tokens = jax.ShapeDtypeStruct((16, 64), jnp.int32)
        batch = {"tokens": tokens, "targets": tokens, "mask": jax.ShapeDtypeStruct((16, 64), jnp.float32)}
        prog.lower("train_step", state, batch)  # traced and lowered: every op of the step has a lowering
    else:
        prog = compile_experiment(exp)
        params = jax.eval_shape(lambda: prog.init(0, split_layers=True))
        fn = prog.generate_fn(params, 1, 2, SamplingRule(0.0, None, None))
        jax.eval_shape(fn, params, jax.ShapeDtypeStruct((1, 3), jnp.int32), jax.ShapeDtypeStruct((), jnp.uint32),
                       jax.ShapeDtypeStruct((), jnp.int32))


@pytest.mark.parametrize("task", ["train", "generate"])
@pytest.mark.parametrize("where", ["default", "params", "rule", "compute"])
def test_every_numeric_type_is_refused_at_check_or_runs(specs, where, task):
    accepted, spec = [], specs[task]
    for base in BASE_TYPES:
        for mod in MODIFIERS:
            over = _overrides(base + mod, where)
            refused = _check(spec, over)
            if refused:  # at the value written, under its key
                assert all(d.span is not None and d.key.startswith("numerics.") for d in refused), refused
                continue
            accepted.append(base + mod)
            _lowers(spec, over, task)
    # what is honoured today: fp32 / bf16 / fp16 compute accumulating in fp32, or in bf16 where every product
    # honours it (not the grouped experts' backward: GPT-OSS trains with @accum(fp32)); mxfp4 weights for inference
    if where == "default":
        compute = ["fp32", "bf16", "fp16"]
        if task == "generate":  # no gradients: no loss scaling
            extra = [f"{b} @accum(bf16)" for b in compute]
        else:  # loss scaling runs in the train step
            extra = [f"{b} @loss_scale({s})" for b in compute for s in ("1024.0", "dynamic")]
        extra.append("fp8_e4m3 @scale(per_tensor)")  # products with weights in fp8, activations bf16
        extra.append("fp8_e4m3 @scale(per_block(32))")  # the same products, scaled per 1×32 / 32×32 block
        extra.append("fp8_e4m3 @scale(delayed)")  # scaled from amax histories in the train state (per_tensor's at
        # inference)
        assert sorted(accepted) == sorted(["fp32", "fp32 @accum(fp32)", "bf16", "bf16 @accum(fp32)", "fp16",
                                           "fp16 @accum(fp32)"] + extra)
    elif where == "params":
        assert accepted == ["fp32", "bf16", "fp16"]
    elif where == "compute":  # a per-op compute rule under the spec's fp32 default: the program's own type (fp8
        # per op only under an fp8 default: tests/lower/test_fp8_compute_rules.py)
        assert accepted == ["fp32", "fp32 @accum(fp32)"]
    else:
        plain = ["fp32", "fp32 @accum(fp32)", "bf16", "bf16 @accum(fp32)", "fp16", "fp16 @accum(fp32)"]
        fp8 = ["fp8_e4m3", "fp8_e4m3 @accum(fp32)", "fp8_e4m3 @scale(per_block(32))",  # held as fp8 arrays, the
               "fp8_e5m2", "fp8_e5m2 @accum(fp32)"]  # per_block one with an fp32 scale per 32×32 block (FP8Blocks)
        packed = ["mxfp4", "mxfp4 @accum(fp32)", "mxfp4 @scale(per_block(32))"]
        assert accepted == plain + (fp8 + packed if task == "generate" else [])


@pytest.mark.parametrize("numeric,says", [
    ("bf16 @scale(per_tensor)", "`@scale(per_tensor)` is not applied to `bf16` compute, so"),
    ("fp16 @accum(fp32) @scale(delayed)", "`@scale(delayed)` is not applied to `fp16` compute, so"),
    ("bf16 @accum(bf16)", "`@accum(bf16)` is honoured by the experts' grouped products forward only: their weight "
                          "gradients would accumulate in fp32 (`moe` at models/gpt_oss.tsl:17:16)"),
])
def test_an_ignored_modifier_is_refused_where_it_is_written(capsys, numeric, says):
    assert main(["check", SPEC, "--set", f"numerics.default={numeric}"]) == 2
    assert f"<--set>:1:18: error: numerics.default: {says}" in capsys.readouterr().err


def test_a_rule_storing_a_type_the_program_cannot_hold_or_train_is_refused(capsys):
    assert main(["check", SPEC, "--set", f"numerics.rules={json.dumps({RULE: 'fp6_e2m3'})}"]) == 2
    assert f"error: numerics.rules: rule `{RULE}`: parameters cannot be held in `fp6_e2m3` yet (no lowering has an " \
        "array type for it)" in capsys.readouterr().err
    assert main(["check", SPEC, "--set", f"numerics.rules={json.dumps({RULE: 'fp8_e4m3'})}"]) == 2
    assert f"error: numerics.rules: rule `{RULE}`: parameters held in `fp8_e4m3` are inference storage: training " \
        "would update fp8 values in place" in capsys.readouterr().err
    generate = str(ROOT / "specs" / "gpt_oss_20b.yaml")  # loss scaling where nothing trains
    assert main(["check", generate, "--set", "numerics.loss_scale=dynamic"]) == 2
    assert "numerics.loss_scale: loss scaling `dynamic` applies to training; a `generate` task computes no " \
        "gradients, so it would not be honoured" in capsys.readouterr().err
