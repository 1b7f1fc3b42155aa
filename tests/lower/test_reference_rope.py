"""RoPE references against transformers: YaRN frequencies and concentration, Llama-3 scaling, application."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from tessera.lower.reference import rope

from .conftest import float64

GPT_OSS_YARN = dict(head_dim=64, theta=150000.0, factor=32.0, original=4096, beta_fast=32.0, beta_slow=1.0)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_inv_freq_matches_transformers(gpt_oss_pieces, truncate):
    inv_freq, scaling = rope.yarn_inv_freq(**GPT_OSS_YARN, truncate=truncate)
    want = gpt_oss_pieces[f"yarn64.truncate{int(truncate)}.inv_freq"]
    np.testing.assert_allclose(inv_freq, want, rtol=1e-6, atol=0)
    assert scaling == pytest.approx(float(gpt_oss_pieces[f"yarn64.truncate{int(truncate)}.scaling"][0]), rel=1e-6)


def test_yarn_truncate_flag_changes_the_ramp(gpt_oss_pieces):
    # GPT-OSS sets truncate=False; the tables differ, so a wrong default would be caught above
    a = gpt_oss_pieces["yarn64.truncate0.inv_freq"]
    b = gpt_oss_pieces["yarn64.truncate1.inv_freq"]
    assert np.abs(a - b).max() > 1e-4


def test_yarn_concentration_is_point_one_log_factor_plus_one():
    assert rope.yarn_attention_scaling(32.0) == pytest.approx(0.1 * math.log(32.0) + 1.0)
    assert rope.yarn_attention_scaling(1.0) == 1.0


def test_yarn_ramp_ends_interpolate_and_extrapolate():
    inv_freq, _ = rope.yarn_inv_freq(**GPT_OSS_YARN, truncate=False)
    plain = rope.rope_inv_freq(head_dim=64, theta=150000.0)
    np.testing.assert_allclose(inv_freq[:2], plain[:2], rtol=1e-6)  # high frequencies kept
    np.testing.assert_allclose(inv_freq[-2:], plain[-2:] / 32.0, rtol=1e-6)  # low frequencies / factor


def test_tiny_model_rope_tables_match(gpt_oss_pieces):
    inv_freq, scaling = rope.yarn_inv_freq(head_dim=16, theta=150000.0, factor=32.0, original=4096, truncate=False)
    np.testing.assert_allclose(inv_freq, gpt_oss_pieces["rope.inv_freq"], rtol=1e-6)
    cos, sin = rope.rope_cos_sin(jnp.arange(12), inv_freq=inv_freq, scaling=scaling)
    np.testing.assert_allclose(cos, gpt_oss_pieces["rope.cos"], atol=2e-6)
    np.testing.assert_allclose(sin, gpt_oss_pieces["rope.sin"], atol=2e-6)


def test_llama3_inv_freq_matches_transformers(gpt_oss_pieces):
    got = rope.llama3_inv_freq(head_dim=64, theta=500000.0, factor=32.0, original=8192)
    np.testing.assert_allclose(got, gpt_oss_pieces["llama3_64.inv_freq"], rtol=1e-6)


def test_apply_rope_is_rotate_half():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    cos, sin = rope.rope_cos_sin(jnp.arange(5), inv_freq=rope.rope_inv_freq(head_dim=8, theta=10000.0))
    got = np.asarray(rope.apply_rope(jnp.asarray(x), cos=cos, sin=sin))
    c = np.concatenate([cos, cos], -1)[None, :, None, :]
    s = np.concatenate([sin, sin], -1)[None, :, None, :]
    rotated = np.concatenate([-x[..., 4:], x[..., :4]], -1)
    np.testing.assert_allclose(got, x * c + rotated * s, atol=1e-6)
    np.testing.assert_allclose(got[:, 0], x[:, 0], atol=1e-6)  # position 0 is the identity
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_apply_rope_gradient():
    with float64():
        x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 4, 2, 8)))
        cos, sin = rope.rope_cos_sin(jnp.arange(4), inv_freq=rope.rope_inv_freq(head_dim=8, theta=10000.0),
                                     scaling=1.3)
        check_grads(lambda x: rope.apply_rope(x, cos=cos.astype(jnp.float64), sin=sin.astype(jnp.float64)),
                    (x,), order=1, modes=("rev",))


def test_every_registered_rope_kind_lowers_to_its_reference_tables():
    """Each kind the model language accepts has a lowering (a llama3 rope once passed the checks and then
    failed in the lowering), and its tables are the reference's."""
    from tessera.ir.registry import struct_families
    from tessera.ir.types import Struct
    from tessera.lower.ops_nn import _rope_tables

    want = {"rotary": (rope.rope_inv_freq(head_dim=64, theta=10000.0), 1.0),
            "yarn": rope.yarn_inv_freq(head_dim=64, theta=150000.0, factor=32.0, original=4096, truncate=True),
            "llama3": (rope.llama3_inv_freq(head_dim=64, theta=500000.0, factor=8.0, original=8192), 1.0),
            "rotary2d": (np.tile(rope.rope_inv_freq(head_dim=32, theta=100.0), 2), 1.0)}
    assert set(struct_families()["rope"]) == set(want)
    for kind in struct_families()["rope"]:
        table = _rope_tables(Struct(kind, ()), 64)  # every field left to its default
        np.testing.assert_array_equal(table.inv_freq, want[kind][0])
        assert table.scaling == want[kind][1]
        assert table.cols == (9 if kind == "rotary2d" else None)
    inv_freq = _rope_tables(Struct("llama3", (("factor", 32.0),)), 64).inv_freq
    np.testing.assert_array_equal(inv_freq, rope.llama3_inv_freq(head_dim=64, theta=500000.0, factor=32.0,
                                                                  original=8192))


def test_a_llama_with_llama3_rope_runs(tmp_path):
    """End to end: the model file's rope swapped for `llama3(...)` checks, compiles and gives finite logits
    that differ from the plain rotary model's."""
    from pathlib import Path

    import tessera

    root = Path(__file__).resolve().parents[2]
    source = (root / "models" / "llama.tsl").read_text()
    assert "rotary(theta = rope_theta)" in source
    model = tmp_path / "llama3.tsl"
    llama3 = "llama3(theta = rope_theta, factor = 32.0, original = 16)"  # scales wavelengths above 16 positions
    model.write_text(source.replace("rotary(theta = rope_theta)", llama3))
    small = {"model.args.layers": 1, "model.args.d_model": 32, "model.args.heads": 2, "model.args.kv_heads": 1,
             "model.args.head_dim": 16, "model.args.d_ff": 32}
    tokens = np.arange(40, dtype=np.int32).reshape(1, 40) % 256
    logits = {}
    for name, file in (("llama3", str(model)), ("rotary", str(root / "models" / "llama.tsl"))):
        exp = tessera.load(str(root / "specs" / "llama_tiny.yaml"), overrides={**small, "model.file": file})
        prog = tessera.compile(exp)
        logits[name] = np.asarray(prog.forward(prog.init(0), tokens))
    assert np.isfinite(logits["llama3"]).all()
    assert np.abs(logits["llama3"] - logits["rotary"]).max() > 1e-4
