"""The MXFP4 expert matmul at decode sizes against dequantise + lax.ragged_dot and bf16 peers, GB/s of the
routed experts' packed bytes (`--only mxfp4`); tune_mxfp4 times its tile variants from profiles
(`--only tune_mxfp4`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench import timing
from bench.timing import copy_bandwidth, record, rel_err, time_rotating


def _decode_routings(tokens: int, top_k: int, g: int, count: int) -> list[np.ndarray]:
    """`count` routings of tokens x top_k distinct experts; one token: disjoint expert sets."""
    rng = np.random.default_rng(tokens * g)
    out = []
    for i in range(count):
        if tokens == 1:
            ids = (np.arange(top_k) + i * top_k) % g
        else:
            ids = np.concatenate([rng.choice(g, top_k, replace=False) for _ in range(tokens)])
        out.append(np.bincount(ids, minlength=g).astype(np.int32))
    return out


def _mxfp4_experts(g: int, k: int, n: int, seed: int = 3):
    """Random packed experts [G, K, N] (every E2M1 code; scales near 2^-6) on the device."""
    from tessera.lower.reference.mxfp4 import MXFP4
    ks = jax.random.split(jax.random.key(seed), 2)
    codes = jax.random.bits(ks[0], (g, k // 2, n), jnp.uint8)
    scales = jax.random.randint(ks[1], (g, k // 32, n), 118, 124).astype(jnp.uint8)
    return MXFP4(codes, scales)


def _mxfp4_impls(g: int, k: int, n: int, cap: int):
    """(name, fn(lhs, rhs, w_bf16, sizes)) for Tessera and the peers."""
    from tessera.lower.kernels.grouped_matmul import grouped_matmul
    from tessera.lower.kernels.mxfp4_matmul import ragged_dot, ragged_dot_reference

    def padded(lhs, rhs, w, sizes):  # scatter rows into [G, cap, K], batched einsum over all experts
        ends = jnp.cumsum(sizes)
        grp = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")
        slot = jnp.minimum(grp, g - 1) * cap + jnp.arange(lhs.shape[0]) - (ends - sizes)[jnp.minimum(grp, g - 1)]
        buf = jnp.zeros((g * cap, k), lhs.dtype).at[slot].set(lhs, mode="drop").reshape(g, cap, k)
        out = jnp.einsum("gck,gkn->gcn", buf, w, preferred_element_type=jnp.float32).reshape(g * cap, n)
        return jnp.where((grp < g)[:, None], out[slot], 0).astype(lhs.dtype)

    return [("tessera mxfp4 (pallas triton)", lambda x, r, w, s: ragged_dot(x, r, s)),
            ("XLA dequant + lax.ragged_dot", lambda x, r, w, s: ragged_dot_reference(x, r, s)),
            ("bf16 grouped_matmul (mosaic gpu)", lambda x, r, w, s: grouped_matmul(x, w, s)),
            ("bf16 lax.ragged_dot (XLA)", lambda x, r, w, s: jax.lax.ragged_dot(x, w, s)),
            ("bf16 padded batched einsum", padded)]


def run_mxfp4(check: bool = False, experts=((32, 5760), (32, 2880), (128, 5760), (128, 2880))) -> None:
    """GPT-OSS expert matmuls at decode: M = tokens x top-4 rows, GB/s of the routed experts' packed bytes.

    Every row counts the same bytes (packed codes + scales of the experts the routing touches,
    lhs, out), so the bf16 peers' rate reads as 'speed in packed-byte terms'.
    """
    from tessera.lower.kernels.mxfp4_matmul import ragged_dot, ragged_dot_reference
    from tessera.lower.reference.mxfp4 import dequantize
    ceiling = copy_bandwidth()
    timing.ROWS.append(("memory ceiling (copy)", "jnp copy", 0.0, ceiling, "GB/s"))
    print(f"  copy bandwidth {ceiling:.0f} GB/s", flush=True)
    k = 2880
    for g, n in experts:
        rhs = _mxfp4_experts(g, k, n)
        w = dequantize(rhs)
        for tokens in (1, 8, 64):
            m = tokens * 4
            routings = _decode_routings(tokens, 4, g, count=8)
            active = np.mean([(s > 0).sum() for s in routings])
            nbytes = active * (k // 2 + k // 32) * n + 2 * m * (k + n)
            lhs = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            sizes = [jnp.asarray(s) for s in routings]
            case = f"mxfp4 decode M{m} G{g} {k}->{n}"
            if check:
                err = rel_err(ragged_dot(lhs, rhs, sizes[0]), ragged_dot_reference(lhs, rhs, sizes[0]))
                print(f"  check {case}: rel err {err:.2e}")
            cap = int(-(-max(s.max() for s in routings) // 8) * 8)
            for name, fn in _mxfp4_impls(g, k, n, cap):
                record(case, name, lambda: time_rotating(fn, (lhs, rhs, w), sizes, iters=10), nbytes, "GB/s")
            ours = [r[3] for r in timing.ROWS if r[0] == case and r[1].startswith("tessera")]
            if ours:
                print(f"  {case}: tessera at {ours[0] / ceiling:.0%} of the copy ceiling", flush=True)
        del rhs, w


MXFP4_TUNE = [  # label -> Mxfp4Config fields over the default; splits = K steps / steps per program
    ("default", {}),
    ("loads in the step (ahead 0)", dict(ahead=0)),
    ("ahead 2", dict(ahead=2)),
    ("ahead 1 splits 3", dict(ahead=1, splits=3)),
    ("ahead 1 splits 9", dict(ahead=1, splits=9)),
    ("ahead 1 splits 15", dict(ahead=1, splits=15)),
    ("ahead 1 n32", dict(ahead=1, block_n=32)),
    ("ahead 1 n128", dict(ahead=1, block_n=128)),
    ("ahead 1 k128", dict(ahead=1, block_k=128)),
    ("ahead 1 warps 2", dict(ahead=1, num_warps=2)),
    ("fma m1 k64 n64 s6", dict(block_m=1, block_k=64, block_n=64, splits=6)),
]


def tune_mxfp4(check: bool = False) -> None:
    """MXFP4 expert matmul tile variants at decode shapes, timed from profiles (GPU busy time per call,
    the tile table and split-K sum included): the calls are 5-50 us, where the slope of host timing jitters."""
    import dataclasses
    from bench.trace import profile_us
    from tessera.lower.kernels.mxfp4_matmul import default_config, ragged_dot, ragged_dot_reference
    k = 2880
    for tokens, g, n in [(1, 32, 2880), (1, 128, 2880), (8, 32, 2880), (64, 32, 2880)]:
        rhs, m = _mxfp4_experts(g, k, n), tokens * 4
        routings = _decode_routings(tokens, 4, g, count=8)
        nbytes = np.mean([(s > 0).sum() for s in routings]) * (k // 2 + k // 32) * n + 2 * m * (k + n)
        lhs = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        sizes = [jnp.asarray(s) for s in routings]
        base = default_config(m, k, n, g)
        want = ragged_dot_reference(lhs, rhs, sizes[0]) if check else None
        for label, kw in MXFP4_TUNE:
            cfg = dataclasses.replace(base, **kw)
            fn = lambda x, r, s, cfg=cfg: ragged_dot(x, r, s, config=cfg)
            case = f"tune mxfp4 M{m} G{g} {k}->{n}"
            try:
                err = f" rel err {rel_err(jax.jit(fn)(lhs, rhs, sizes[0]), want):.1e}" if check else ""
                busy, span = profile_us(fn, (lhs, rhs), sizes, breakdown=label == "default")
            except Exception as e:  # a variant Triton cannot compile must not stop the sweep
                print(f"  {case} / {label}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            timing.ROWS.append((case, f"tessera {label}", busy / 1e3, nbytes / (busy * 1e-6) / 1e9, "GB/s"))
            print(f"  {case:<30} {label:<24} busy {busy:7.1f} us  span {span:7.1f} us "
                  f"{timing.ROWS[-1][3]:7.0f} GB/s{err}", flush=True)
        del rhs
