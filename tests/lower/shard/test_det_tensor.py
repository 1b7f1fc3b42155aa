"""Deterministic tp's operators (tessera/lower/shard/det_tensor.py): a block whose contractions over heads and d_ff are
canonical chunk trees gives one device's bits on tp=2 and tp=4 (8 host devices, tp x dp meshes): its output, the
gradient of its input and each device's block of every weight gradient, in bf16 with fp32 accumulation as the
language models compute, with XLA's excess precision off (`EXACT`: with it on, XLA:CPU fused the bf16 rounding of
silu's input away in the tp programs and not in one device's, and the down projection's gradient was a bf16 ulp off).
fast mode's psum of the partials is shown to differ on tp=4, so the test can fail."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.cpu_env import cpu_env
from tests.lower.shard.conftest import ROOT

SCRIPT = r"""
import json, sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from tessera.lower.shard.det_tensor import chunked, fan_out, reduce_chunks, unchunked

T = 4                     # canonical chunks
B, S, E, H, D, F = 2, 16, 64, 8, 16, 256
F32 = dict(preferred_element_type=jnp.float32)
rng = np.random.default_rng(0)
bf = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.2, jnp.bfloat16)
x, q, o, up, down, ct = bf(B, S, E), bf(E, H, D), bf(H, D, E), bf(E, F), bf(F, E), bf(B, S, E)

def block(x, q, o, up, down, k, axes, plain=False):
    # q [E, H', D] and up [E, F'] split by columns, o [H', D, E] and down [F', E] by rows: this device's k chunks
    xs = jnp.broadcast_to(x, (k,) + x.shape) if plain else fan_out(x, k, axes)
    h = jnp.einsum("kbse,kehd->kbshd", xs, chunked(q, 1, k), **F32).astype(jnp.bfloat16)
    a = jnp.einsum("kbshd,khde->kbse", jnp.tanh(h), chunked(o, 0, k), **F32)
    u = jnp.einsum("kbse,kef->kbsf", xs, chunked(up, 1, k), **F32).astype(jnp.bfloat16)
    m = jnp.einsum("kbsf,kfe->kbse", jax.nn.silu(u), chunked(down, 0, k), **F32)
    parts = a + m
    if plain:  # fast mode's arithmetic: the local sum, then psum over tp
        y = parts.sum(0)
        return jax.lax.psum(y, axes) if axes else y
    return reduce_chunks(parts, axes)

def grads(x, q, o, up, down, ct, k, axes, plain=False):
    y, vjp = jax.vjp(lambda *a: block(*a, k, axes, plain), x, q, o, up, down)
    return (y,) + vjp(ct.astype(y.dtype))

ref = jax.jit(lambda *a: grads(*a, T, ()))(x, q, o, up, down, ct)
devices = np.array(jax.devices())
out = {}
for tp in (2, 4):
    mesh = Mesh(devices.reshape(8 // tp, tp), ("dp", "tp"))
    rep = P()
    specs = (rep, P(None, "tp", None), P("tp", None, None), P(None, "tp"), P("tp", None), rep)
    for plain in (False, True):
        fn = jax.jit(jax.shard_map(lambda *a: grads(*a, T // tp, ("tp",), plain), mesh=mesh, in_specs=specs,
                                   out_specs=(rep, rep) + specs[1:5], check_vma=False))
        got = fn(x, q, o, up, down, ct)
        names = ("y", "dx", "dq", "do", "dup", "ddown")
        out[f"tp={tp}{' plain' if plain else ''}"] = {
            n: [bool(np.array_equal(np.asarray(g), np.asarray(r))),
                float(np.max(np.abs(np.asarray(g, np.float32) - np.asarray(r, np.float32))))]
            for n, g, r in zip(names, got, ref)}
# the chunking round-trips
w = jnp.arange(2 * 12 * 3).reshape(2, 12, 3)
out["round trip"] = bool(np.array_equal(np.asarray(unchunked(chunked(w, 1, 4), 1)), np.asarray(w)))
print("RESULT " + json.dumps(out))
"""


EXACT = "--xla_allow_excess_precision=false"


def _run(*flags: str) -> dict:
    env = cpu_env(8)
    env["XLA_FLAGS"] = " ".join([env["XLA_FLAGS"], *flags])
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "RESULT " in proc.stdout, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def results():
    return _run(EXACT)


@pytest.mark.parametrize("tp", [2, 4])
def test_canonical_chunk_trees_give_one_devices_bits(results, tp):
    got = results[f"tp={tp}"]
    assert all(equal for equal, _ in got.values()), got


def test_a_psum_of_the_partials_does_not(results):
    # tp=2: a local sum of two chunks and a psum of two devices are the tree's adds; tp=4's psum is not
    assert results["tp=2 plain"]["y"][0] and 0 < results["tp=4 plain"]["y"][1] < 1e-5


def test_chunks_round_trip(results):
    assert results["round trip"]
