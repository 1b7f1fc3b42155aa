"""decode_qkv (a decode step's biases, rotary embedding and KV-cache write in one kernel) against
reference.kv_cache.decode_qkv, on the interpreter and (marked gpu) at GPT-OSS's head shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.kernels import decode_qkv as dq
from tessera.lower.reference import kv_cache, rope

INTERPRET = dq.QkvConfig(interpret=True)


def _case(seed: int, b: int, h: int, hkv: int, d: int, c: int, start: int, biased: bool = True):
    rng = np.random.default_rng(seed)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)  # noqa: E731
    q, k, v = bf(b, 1, h, d), bf(b, 1, hkv, d), bf(b, 1, hkv, d)
    cache = {"k": bf(b, c, hkv, d), "v": bf(b, c, hkv, d),
             "pos": jnp.asarray(rng.integers(-1, start, (b, c)), jnp.int32)}
    pos = jnp.full((b, 1), start, jnp.int32)
    cos, sin = rope.rope_cos_sin(pos, inv_freq=rope.rope_inv_freq(head_dim=d, theta=150000.0), scaling=1.3)
    biases = {f"{n}_bias": (jnp.asarray(rng.standard_normal((m, d)) * 0.1, jnp.float32) if biased else None)
              for n, m in (("q", h), ("k", hkv), ("v", hkv))}
    return (q, k, v, cache, pos), dict(cos=cos, sin=sin, dtype=jnp.bfloat16, **biases)


def _run(fn, args, kw):
    """fn under jit, the step's start traced (as in the decode loop)."""
    q, k, v, cache, pos = args
    start = int(pos[0, 0])
    return jax.jit(lambda q, k, v, cache, pos, s: fn(q, k, v, cache, pos, s, **kw))(q, k, v, cache, pos,
                                                                                     jnp.int32(start))


@pytest.mark.parametrize("b,h,hkv,d,c,start,biased", [
    (2, 4, 2, 16, 8, 13, True),   # a ring buffer that has wrapped (slot 13 % 8), biases, two rows
    (1, 2, 1, 32, 64, 5, False),  # no biases, a cache not yet full
])
def test_interpreted_decode_qkv_is_the_reference(b, h, hkv, d, c, start, biased):
    args, kw = _case(b + d + start, b, h, hkv, d, c, start, biased)
    assert dq.supported(*args, jnp.int32(start), config=INTERPRET, **kw)
    got_q, got = _run(functools.partial(dq.decode_qkv, config=INTERPRET), args, kw)
    want_q, want = _run(kv_cache.decode_qkv, args, kw)
    np.testing.assert_array_equal(np.asarray(got_q, np.float32), np.asarray(want_q, np.float32))
    for name in ("k", "v", "pos"):
        np.testing.assert_array_equal(np.asarray(got[name], np.float32), np.asarray(want[name], np.float32))
    assert int(got["pos"][0, start % c]) == start  # the new token's slot holds its position
    cache = args[3]
    untouched = np.arange(c) != start % c  # every other slot as it was
    np.testing.assert_array_equal(np.asarray(got["k"], np.float32)[:, untouched],
                                  np.asarray(cache["k"], np.float32)[:, untouched])


def test_supported_wants_one_token_a_traced_start_and_matching_caches():
    args, kw = _case(0, 1, 2, 1, 16, 8, 3)
    q, k, v, cache, pos = args
    s = jnp.int32(3)
    assert dq.supported(q, k, v, cache, pos, s, config=INTERPRET, **kw)
    assert not dq.supported(q, k, v, cache, pos, 3, config=INTERPRET, **kw)  # a known start: the prompt's write
    assert not dq.supported(jnp.concatenate([q, q], 1), k, v, cache, pos, s, config=INTERPRET, **kw)
    assert not dq.supported(q, k, v, {**cache, "k": cache["k"].astype(jnp.float32)}, pos, s, config=INTERPRET,
                            **kw)
    assert not dq.supported(q, k, v, cache, pos, s, **kw)  # the CPU without the interpreter


@pytest.mark.gpu
def test_gpu_decode_qkv_is_the_reference():
    """On a GPU at GPT-OSS's heads (64 q heads, 8 kv heads of 64, a 128-slot window): the cache bitwise, q and the
    rotated k within a bf16 rounding of the reference (Triton may contract the rotation's multiply-adds)."""
    args, kw = _case(1, 1, 64, 8, 64, 128, 300)
    assert dq.supported(*args, jnp.int32(300), **kw)
    got_q, got = _run(dq.decode_qkv, args, kw)
    want_q, want = _run(kv_cache.decode_qkv, args, kw)
    for a, w in ((got_q, want_q), (got["k"], want["k"])):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)
    for name in ("v", "pos"):
        np.testing.assert_array_equal(np.asarray(got[name], np.float32), np.asarray(want[name], np.float32))
