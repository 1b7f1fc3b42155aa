"""fp8 weights with per-block scales for inference: a rule `fp8_e4m3 @scale(per_block(N))` holds each parameter as
one e4m3 byte a weight plus one fp32 scale per N×N block of its last two dims (`FP8Blocks`), quantised by
scale = amax · fp32(1/448) per block; the lowerings dequantise at use, and `tessera plan` counts N² + 4 bytes a block."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

import tessera
from tessera.cli import main
from tessera.diagnostics import TesseraError
import tessera.lower.kernels  # noqa: F401  (fills the lowering table, whose reference the decode test wraps)
from tessera.lower import table
from tessera.lower.program import compile_experiment
from tessera.lower.reference import fp8_blocks
from tessera.lower.reference.fp8_blocks import FP8Blocks
from tessera.spec import load_experiment
from tessera.spec.tasks import ForwardTask

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
RULES = {"embed/table": f"fp8_e4m3 @scale(per_block({BLOCK}))", "*/mlp/*": f"fp8_e4m3 @scale(per_block({BLOCK}))"}
HELD = ("embed/table", "layers/mlp/gate", "layers/mlp/up", "layers/mlp/down")
TOKENS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]


def numpy_quantize(w: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The quantiser's model: per n×n block of the last two dims, scale = amax · fp32(1/448) (1 if amax = 0),
    codes e4m3(w / scale) rounded to nearest even."""
    *lead, k, m = w.shape
    g = w.astype(np.float32).reshape(*lead, k // n, n, m // n, n)
    amax = np.abs(g).max(axis=(-3, -1))
    scales = np.where(amax > 0, amax * np.float32(1 / 448), np.float32(1)).astype(np.float32)
    q = np.clip(g / scales[..., :, None, :, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(w.shape), scales


# ---- the format ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,n", [((64, 96), 32), ((3, 128, 256), 128), ((2, 32, 16), 16)])
def test_quantize_matches_the_numpy_model(shape, n):
    w = np.random.default_rng(n).standard_normal(shape).astype(np.float32) * np.float32(0.02)
    w[..., :n, :n] = 0.0  # an all-zero block: scale 1, codes 0
    w[..., -1, -1] = 3.0  # one block with an outlier: its scale is 3/448
    got = fp8_blocks.quantize(jnp.asarray(w), n)
    codes, scales = numpy_quantize(w, n)
    assert got.codes.dtype == jnp.float8_e4m3fn and got.scales.dtype == jnp.float32 and got.block == n
    assert got.scales.shape == (*shape[:-2], shape[-2] // n, shape[-1] // n)
    np.testing.assert_array_equal(np.asarray(got.codes).view(np.uint8), codes.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got.scales), scales)
    assert float(got.scales[..., 0, 0].max()) == 1.0 and float(got.scales[..., -1, -1].min()) == np.float32(3) * np.float32(1 / 448)
    # each block's largest magnitude lands on ±448 exactly
    assert float(jnp.abs(got.codes.astype(jnp.float32))[..., -n:, -n:].max()) == 448.0


def test_round_trip_error_is_within_half_an_e4m3_step():
    w = np.random.default_rng(0).standard_normal((4, 128, 128)).astype(np.float32)
    w *= np.float32(10.0) ** np.random.default_rng(1).integers(-3, 2, (4, 1, 1)).astype(np.float32)
    q = fp8_blocks.quantize(jnp.asarray(w), 64)
    back = np.asarray(fp8_blocks.dequantize(q, jnp.float32))
    scale = np.repeat(np.repeat(np.asarray(q.scales), 64, axis=-2), 64, axis=-1)
    # e4m3: 3 mantissa bits (half a step is 2^-4 relative) down to 2^-6, subnormal steps of 2^-9 below (of w/scale)
    bound = np.abs(w) * 2.0**-4 + scale * 2.0**-10
    assert np.all(np.abs(back - w) <= bound)
    assert 0 < np.abs(back - w).max() and np.abs(back - w).mean() < 0.03 * np.abs(w).mean()  # ~2.2 % measured


# ---- a tiny Llama forward held in per-block fp8 -----------------------------------------------------------------

def _spec(directory: Path, rules: dict | None = None, task: dict | None = None) -> Path:
    spec = load_experiment(str(ROOT / "specs" / "llama_tiny.yaml")).resolved()
    spec["model"]["file"] = str(ROOT / "models" / "llama.tsl")
    spec["task"] = task or {"kind": "forward", "tokens": TOKENS}
    spec["numerics"] = {"default": "bf16 @accum(fp32)", "params": "bf16", **({"rules": rules} if rules else {})}
    path = directory / f"llama_{abs(hash(json.dumps([rules, task], sort_keys=True)))}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """(per-block fp8 program, its params, bf16 program, spec path)."""
    d = tmp_path_factory.mktemp("fp8_blocks")
    held = compile_experiment(load_experiment(str(_spec(d, RULES))))
    plain = compile_experiment(load_experiment(str(_spec(d))))
    return held, held.init(0), plain, _spec(d, RULES)


def test_params_are_held_as_codes_and_block_scales_drawn_from_the_plain_init(programs, tmp_path):
    held, params, plain, _ = programs
    fp32 = compile_experiment(load_experiment(  # the plain init at fp32: the same keys draw the same normals
        str(_spec(tmp_path)), overrides={"numerics.params": "fp32"})).init(0)
    for path in HELD:
        w = params[path]
        assert isinstance(w, FP8Blocks) and w.block == BLOCK and w.codes.dtype == jnp.float8_e4m3fn
        assert w.nbytes == w.codes.size + 4 * w.codes.size // BLOCK**2
        want = fp8_blocks.quantize(fp32[path], BLOCK)
        np.testing.assert_array_equal(np.asarray(w.codes).view(np.uint8), np.asarray(want.codes).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(w.scales), np.asarray(want.scales))
    assert params["layers/attention/q"].dtype == jnp.bfloat16  # the rule's paths only


def test_forward_equals_the_dequantised_forward_and_is_close_to_bf16(programs):
    held, params, plain, _ = programs
    tokens = jnp.asarray(TOKENS, jnp.int32)
    logits = np.asarray(held.forward(params, tokens), np.float32)
    dequantised = {k: fp8_blocks.dequantize(v, jnp.bfloat16) if isinstance(v, FP8Blocks) else v
                   for k, v in params.items()}
    np.testing.assert_array_equal(logits, np.asarray(plain.forward(dequantised, tokens), np.float32))
    reference = np.asarray(plain.forward(plain.init(0), tokens), np.float32)  # the unquantised bf16 draw
    err = np.abs(logits - reference)
    # measured: max 2.7 % of the largest logit, mean 4 % of the mean |logit| (e4m3 weights: ~2.2 % each)
    assert 0 < err.max() <= 0.05 * np.abs(reference).max() and err.mean() <= 0.06 * np.abs(reference).mean()


@pytest.mark.parametrize("spec,xs,ws,n", [("bse,ehd->bshd", (1, 1, 64), (64, 4, 32), 4),  # blocks across the heads
                                          ("bshd,hde->bse", (1, 1, 4, 32), (4, 32, 64), 32),
                                          ("bsf,fe->bse", (1, 1, 96), (96, 64), 32)])
def test_the_one_token_product_is_the_dequantised_product(spec, xs, ws, n):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal(xs), jnp.bfloat16)
    w = fp8_blocks.quantize(jnp.asarray(rng.standard_normal(ws) * 0.05, jnp.float32), n)
    got = fp8_blocks.weight_only_einsum(spec, x, w, compute_dtype=jnp.bfloat16, out_dtype=jnp.float32)
    want = np.einsum(spec, np.asarray(x, np.float64), np.asarray(fp8_blocks.dequantize(w, jnp.bfloat16), np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # one fused multiply-reduce over the codes: no dot, so no dequantised copy of W for a dot to read
    prims = {e.primitive.name for e in jax.make_jaxpr(
        lambda x, w: fp8_blocks.weight_only_einsum(spec, x, w, compute_dtype=jnp.bfloat16, out_dtype=jnp.float32)
    )(x, w).jaxpr.eqns}
    assert "dot_general" not in prims and "reduce_sum" in prims


def test_batch_one_decode_multiplies_the_held_codes_and_generates_the_dequantised_tokens(programs, monkeypatch):
    held, params, plain, _ = programs
    calls = []
    real = fp8_blocks.weight_only_einsum  # the lowering table's reference for it (no kernel on the CPU)
    monkeypatch.setitem(table.PRIMITIVES, "weight_only_einsum", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    dequantised = {k: fp8_blocks.dequantize(v, jnp.bfloat16) if isinstance(v, FP8Blocks) else v
                   for k, v in params.items()}
    prompt = np.asarray([TOKENS[0][:5]], np.int32)
    got = np.asarray(held.generate(params, prompt, max_new_tokens=6))
    assert sorted(set(calls)) == ["bse,ef->bsf", "bsf,fe->bse"]  # gate, up and down of the decode step
    np.testing.assert_array_equal(got, np.asarray(plain.generate(dequantised, prompt, max_new_tokens=6)))
    calls.clear()  # a batch of two tokens a step (and the forward's whole sequences) dequantise as before
    held.generate(params, np.asarray([p[:5] for p in TOKENS], np.int32), max_new_tokens=2)
    assert calls == []


def test_plan_counts_a_byte_per_weight_and_four_per_block(programs, capsys):
    held, params, _, spec = programs
    assert main(["plan", str(spec), "--no-compile", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    blocks = sum(params[p].nbytes for p in HELD)
    assert blocks == sum(params[p].codes.size * (1 + 4 / BLOCK**2) for p in HELD)
    assert plan["params"]["bytes_by_dtype"][f"fp8_e4m3_b{BLOCK}"] == blocks
    assert plan["params"]["bytes"] == sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    assert plan["numerics"]["by_param"]["layers/mlp/up"] == {"storage": f"fp8_e4m3_b{BLOCK}", "compute": "bf16",
                                                             "rule": "*/mlp/*"}


def test_checkpoint_round_trip(tmp_path, programs):
    from tessera.run.checkpoint import Checkpoints

    _, params, _, _ = programs
    ckpt = Checkpoints(tmp_path / "ckpt", keep=1)
    ckpt.save(1, params, {"step": 1})
    ckpt.wait()
    restored, _ = ckpt.restore(1, jax.eval_shape(lambda: params))
    ckpt.close()
    assert isinstance(restored["layers/mlp/down"], FP8Blocks)
    for path, value in params.items():
        for x, y in zip(jax.tree.leaves(value), jax.tree.leaves(restored[path])):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), path


def test_a_dense_hf_checkpoint_is_quantised_on_load():
    hf_dir = ROOT / "tests" / "data" / "hf" / "llama"
    fixture = json.loads((hf_dir / "fixture.json").read_text())
    overrides = {f"model.args.{k}": v for k, v in fixture["args"].items()}
    overrides["model.args.rope_theta"] = json.loads((hf_dir / "config.json").read_text())["rope_parameters"]["rope_theta"]
    overrides["task.sample.prompt"] = [1, 2, 3]  # the fixture's vocab is 64
    overrides["numerics.rules"] = {"*/mlp/*": "fp8_e4m3 @scale(per_block(16))"}  # d_model 32, d_ff 48
    exp = tessera.load(ROOT / "specs" / "llama_tiny.yaml", overrides=overrides)
    prog = tessera.compile(exp.model_copy(update={"task": ForwardTask(kind="forward", tokens=[[1, 2]])}))
    params = prog.load_weights(hf_dir)
    gate = load_file(str(hf_dir / "model.safetensors"))["model.layers.1.mlp.gate_proj.weight"]  # [out, in]
    codes, scales = numpy_quantize(np.asarray(gate, np.float32).T, 16)
    got = params["layers/mlp/gate"]
    assert isinstance(got, FP8Blocks) and got.codes.shape == (2, 32, 48)
    np.testing.assert_array_equal(np.asarray(got.codes[1]).view(np.uint8), codes.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got.scales[1]), scales)


# ---- errors a spec can cause -------------------------------------------------------------------------------------

def _rule_line(spec: Path) -> int:
    return next(i for i, s in enumerate(spec.read_text().splitlines(), 1) if s.strip().startswith("'*/mlp/*'"))


def test_a_block_size_that_does_not_divide_is_refused_at_the_rule(tmp_path, capsys):
    spec = _spec(tmp_path, {"*/mlp/*": "fp8_e4m3 @scale(per_block(96))"})  # gate [embed=128, mlp=256]
    assert main(["check", str(spec)]) == 2
    err = capsys.readouterr().err
    assert f"{spec}:{_rule_line(spec)}:" in err and "Traceback" not in err
    assert ("fp8_e4m3 @scale(per_block(96)) needs block size 96 to divide the last two dims of `layers/mlp/gate`; "
            "`embed` = 128 is not a multiple of 96") in err
    assert "e.g. per_block(128)" in err


def test_training_per_block_weights_is_refused_at_the_rule(tmp_path, capsys):
    task = {"kind": "train", "steps": 1, "batch": 2, "seq_len": 8, "data": {"kind": "synthetic", "task": "copy"}}
    spec = _spec(tmp_path, {"*/mlp/*": "fp8_e4m3 @scale(per_block(32))"}, task)
    assert main(["check", str(spec)]) == 2
    err = capsys.readouterr().err
    assert f"{spec}:{_rule_line(spec)}:" in err and "inference storage" in err and "Traceback" not in err


def test_per_block_e5m2_weights_are_refused(tmp_path, capsys):
    spec = _spec(tmp_path, {"*/mlp/*": "fp8_e5m2 @scale(per_block(32))"})
    assert main(["check", str(spec)]) == 2
    err = capsys.readouterr().err
    assert f"{spec}:{_rule_line(spec)}:" in err and "`@scale(per_block(32))` is not applied to `fp8_e5m2`" in err
