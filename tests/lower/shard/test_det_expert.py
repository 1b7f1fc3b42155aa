"""Deterministic ep's operators (tessera/lower/shard/det_expert.py): the experts of a sorted MoE block in Q canonical
chunks, each chunk's gate, up and down products its own ragged products over the rolled buffer, give one device's
bits on ep=2 x dp=4 (8 host devices): the block's output, the token copies' gradient and each device's experts'
weight and bias gradients. The same block by one ragged product over all experts is shown to differ on the half of
the experts, so the test can fail."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cpu_env import cpu_env
from tests.lower.shard.conftest import ROOT

SCRIPT = r"""
import json
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from tessera.lower.shard.det_expert import fan_rows, merge_rows, rolled

E, Q, D, F = 8, 4, 64, 96            # experts, canonical chunks, dims (a single ragged product over half
# the experts at these sizes already parts from the whole one: the control below)
per = E // Q
rng = np.random.default_rng(0)
sizes = np.array([37, 0, 120, 5, 64, 33, 77, 19], np.int32)
M = int(sizes.sum())
sorted_expert = jnp.asarray(np.repeat(np.arange(E), sizes), jnp.int32)
bounds = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
group_sizes = jnp.asarray(sizes)
f32 = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
xs, gate, up, down, gb, ct = f32(M, D), f32(E, D, F), f32(E, D, F), f32(E, F, D), f32(E, F), f32(M, D)
rd = lambda x, w, group_sizes: jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)

def block(xs, gate, up, down, gb, k, first, axes):
    # this device's k chunks of experts (gate [k*per, D, F] ...), from the first-th
    chunk_of_row = sorted_expert // per
    xk = fan_rows(xs, chunk_of_row, first, k, axes)
    parts = []
    for j in range(k):
        q = first + j
        start = bounds[q * per]
        gs = jax.lax.dynamic_slice_in_dim(group_sizes, q * per, per)
        w = lambda a: a[j * per:(j + 1) * per]
        bias = w(gb)[jnp.clip(sorted_expert - q * per, 0, per - 1)]
        g = rolled(rd, xk[j], w(gate), gs, start) + bias
        u = rolled(rd, xk[j], w(up), gs, start)
        parts.append(rolled(rd, jax.nn.silu(g) * u, w(down), gs, start))
    return merge_rows(jnp.stack(parts), chunk_of_row, first, axes)

def grads(xs, gate, up, down, gb, k, first, axes):
    y, vjp = jax.vjp(lambda *a: block(*a, k, first, axes), xs, gate, up, down, gb)
    return (y,) + vjp(ct)

def plain(xs, gate, up, down, gb):  # one ragged product over all experts
    def f(xs, gate, up, down, gb):
        g = rd(xs, gate, group_sizes) + gb[sorted_expert]
        return rd(jax.nn.silu(g) * rd(xs, up, group_sizes), down, group_sizes)
    y, vjp = jax.vjp(f, xs, gate, up, down, gb)
    return (y,) + vjp(ct)

ref = jax.jit(lambda *a: grads(*a, Q, 0, ()))(xs, gate, up, down, gb)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("ep", "dp"))
ex = P("ep")
fn = jax.jit(jax.shard_map(lambda *a: grads(*a, Q // 2, jax.lax.axis_index("ep") * (Q // 2), ("ep",)), mesh=mesh,
                           in_specs=(P(), ex, ex, ex, ex), out_specs=(P(), P(), ex, ex, ex, ex), check_vma=False))
got = fn(xs, gate, up, down, gb)
names = ("y", "dxs", "dgate", "dup", "ddown", "dbias")
out = {"ep=2": {n: bool(np.array_equal(np.asarray(a), np.asarray(b))) for n, a, b in zip(names, got, ref)}}
# the experts 4..7 alone by one ragged product over them, against all 8 in one: not the same bits
full = jax.jit(plain)(xs, gate, up, down, gb)
lo = int(bounds[E // 2])
sizes_h = jnp.asarray(np.concatenate([sizes[E // 2:], np.zeros(E // 2, np.int32)]))
def plain_half(xs, gate, up, down, gb):
    def f(xs, gate, up, down, gb):
        e = jnp.clip(sorted_expert[lo:] - E // 2, 0, E // 2 - 1)
        g = rd(xs, gate, sizes_h[:E // 2]) + gb[e]
        return rd(jax.nn.silu(g) * rd(xs, up, sizes_h[:E // 2]), down, sizes_h[:E // 2])
    y, vjp = jax.vjp(f, xs, gate, up, down, gb)
    return (y,) + vjp(ct[lo:])
h = jax.jit(plain_half)(xs[lo:], gate[E // 2:], up[E // 2:], down[E // 2:], gb[E // 2:])
out["plain half"] = {"dgate": bool(np.array_equal(np.asarray(h[2]), np.asarray(full[2][E // 2:]))),
                     "dxs": bool(np.array_equal(np.asarray(h[1]), np.asarray(full[1][lo:])))}
out["close"] = bool(np.allclose(np.asarray(ref[0]), np.asarray(full[0]), rtol=1e-5, atol=1e-5))
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=cpu_env(8), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "RESULT " in proc.stdout, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def test_expert_chunks_on_ep_give_one_devices_bits(results):
    assert all(results["ep=2"].values()), results["ep=2"]
    assert results["close"]  # the chunked block computes the same MoE as one ragged product


def test_one_ragged_product_over_half_the_experts_does_not(results):
    assert not all(results["plain half"].values()), results["plain half"]
