"""fp8 parameter storage for inference: a rule `fp8_e4m3` / `fp8_e5m2` holds its parameters as one-byte fp8 arrays
(values on the fp8 grid), the program computes with them cast to the compute type, and `tessera plan` counts one
byte each."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from tessera.cli import main
from tessera.lower import storage
from tessera.lower.program import compile_experiment
from tessera.spec import load_experiment
from tests.lower.shard.make_snapshots import ROOT

RULES = {"*/experts/*": "fp8_e4m3", "*/experts/*_bias": "bf16"}
EXPERTS = ("layers/moe/experts/gate", "layers/moe/experts/up", "layers/moe/experts/down")


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    """The tiny GPT-OSS with a forward task, bf16 compute."""
    spec = load_experiment(str(ROOT / "specs" / "gpt_oss_tiny.yaml")).resolved()
    spec["model"]["file"] = str(ROOT / "models" / "gpt_oss.tsl")
    spec["task"] = {"kind": "forward", "tokens": [[1, 2, 3, 4, 5, 6]]}
    spec["model"]["args"]["layers"] = 1
    spec["numerics"] = {"default": "bf16 @accum(fp32)", "params": "bf16"}
    path = tmp_path_factory.mktemp("fp8") / "forward.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def test_fp8_weights_are_held_in_one_byte_and_computed_as_written(spec):
    prog = compile_experiment(load_experiment(spec, overrides={"numerics.rules": RULES}))
    params = prog.init(0)
    for path in EXPERTS:
        assert params[path].dtype == jnp.float8_e4m3fn and params[path].nbytes == params[path].size
    assert params["layers/moe/experts/gate_bias"].dtype == jnp.bfloat16
    # the same weights held in bf16 (exact: every e4m3 value is a bf16 value) give the same logits, bit for bit
    plain = compile_experiment(load_experiment(spec))
    widened = {k: v.astype(jnp.bfloat16) for k, v in params.items()}
    tokens = jnp.asarray([[1, 2, 3, 4, 5, 6]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(prog.forward(params, tokens), np.float32),
                                  np.asarray(plain.forward(widened, tokens), np.float32))
    # and not the logits of the unrounded bf16 draw: the rounding to the fp8 grid is real
    drawn = plain.init(0)
    assert not np.array_equal(np.asarray(drawn["layers/moe/experts/gate"], np.float32),
                              np.asarray(widened["layers/moe/experts/gate"], np.float32))


def test_holding_fp8_saturates_instead_of_making_nan():
    held = storage.to_held(jnp.asarray([500.0, -1e6, 0.3, 1e-4]), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(held, np.float32), [448.0, -448.0, 0.3125, 0.0])
    held = storage.to_held(jnp.asarray([1e6, 3.0]), jnp.float8_e5m2)
    np.testing.assert_array_equal(np.asarray(held, np.float32), [57344.0, 3.0])


def test_plan_counts_one_byte_per_fp8_weight(spec, capsys):
    assert main(["plan", spec, "--no-compile", "--json", "--set", f"numerics.rules={json.dumps(RULES)}"]) == 0
    plan = json.loads(capsys.readouterr().out)
    prog = compile_experiment(load_experiment(spec, overrides={"numerics.rules": RULES}))
    held = prog.init(0)
    fp8 = sum(held[p].size for p in EXPERTS)
    assert plan["params"]["bytes_by_dtype"]["fp8_e4m3"] == fp8
    assert plan["params"]["bytes"] == sum(v.nbytes for v in held.values())
    assert plan["numerics"]["by_param"][EXPERTS[0]] == {"storage": "fp8_e4m3", "compute": "bf16",
                                                        "rule": "*/experts/*"}
