"""Decode attention (one query token per sequence against 4k-64k caches) against cuDNN and XLA, GB/s of
the K/V bytes read, held to the measured copy ceiling (`--only decode`); tune_decode times the kernel's
variants in turns (`--only tune_decode`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench import timing
from bench.timing import copy_bandwidth, record, record_rounds, rel_err, time_rotating


DECODE_SHAPE = (8, 64, 8, 64)  # batch, query heads, KV heads, head dim


def decode_inputs(t: int):
    """One query token per sequence q [B, 1, Hq, D], four caches (k, v) [B, t, Hkv, D] and fp32 sinks [Hq].

    The caches are read in turn: a 4k cache (67 MB) would otherwise be served partly from L2."""
    b, hq, hkv, d = DECODE_SHAPE
    ks = jax.random.split(jax.random.key(t), 3)
    q = jax.random.normal(ks[0], (b, 1, hq, d), jnp.bfloat16)
    caches = [tuple(jax.random.normal(kk, (2, b, t, hkv, d), jnp.bfloat16)) for kk in jax.random.split(ks[1], 4)]
    return q, caches, jax.random.normal(ks[2], (hq,), jnp.float32)


def run_decode(check: bool = False) -> None:
    """One query token per sequence against caches of 4k-64k tokens (GQA 64/8, D 64), GB/s."""
    from bench.trace import profile_us
    from tessera.lower.kernels.decode_attention import decode_attention, decode_attention_reference
    ceiling = copy_bandwidth()
    timing.ROWS.append(("memory ceiling (copy)", "jnp copy", 0.0, ceiling, "GB/s"))
    print(f"  copy bandwidth {ceiling:.0f} GB/s")
    b, hq, hkv, d = DECODE_SHAPE
    for t, window in [(4096, None), (16384, None), (65536, None), (65536, 128)]:
        q, caches, sinks = decode_inputs(t)
        k, v = caches[0]
        keys = t if window is None else window
        nbytes = 2.0 * b * keys * hkv * d * 2 + 2 * q.nbytes
        case = f"decode B{b} T{t} H{hq}/{hkv} D{d}" + (f" w{window}" if window else "") + " sinks"
        ours = lambda q, kv: decode_attention(q, *kv, sinks=sinks, window=window)
        xla = lambda q, kv: decode_attention_reference(q, *kv, sinks=sinks, window=window)
        if check:
            err = rel_err(ours(q, (k, v)), xla(q, (k, v)))
            print(f"  check {case}: rel err {err:.2e}")
        timed = lambda f: (lambda: time_rotating(f, (q,), caches * 5))
        record(case, "tessera (mosaic gpu)", timed(ours), nbytes, "GB/s")
        record(case, "XLA (jnp)", timed(xla), nbytes, "GB/s")
        if window is None:
            cudnn = lambda q, kv: jax.nn.dot_product_attention(q, *kv, implementation="cudnn")
            record(case, "cuDNN (jax.nn.dpa, no sinks)", timed(cudnn), nbytes, "GB/s")
        ours_rate = [r[3] for r in timing.ROWS if r[0] == case and r[1].startswith("tessera")]
        if ours_rate:  # the slope of ~30 us calls jitters: the profile's busy time is the kernels' own
            busy_us, _ = profile_us(ours, (q,), caches)
            print(f"  {case}: tessera at {ours_rate[0] / ceiling:.0%} of the copy ceiling; in a profile "
                  f"{busy_us:.1f} us a call, {nbytes / (busy_us * 1e-6) / 1e9 / ceiling:.0%}", flush=True)


def tune_decode(check: bool = False) -> None:
    """Decode variants (persistent or one CTA per item, compute warpgroups, KV tile, key chunks per
    head), 4k and 16k caches. The default takes one wave of items: 2 chunks a head here."""
    from tessera.lower.kernels.decode_attention import DecodeConfig, decode_attention
    b, hq, hkv, d = DECODE_SHAPE
    variants = [("persistent kv128 2 warpgroups c2 (default)", dict()), ("persistent c4", dict(splits=4)),
                ("persistent 1 warpgroup", dict(compute_warpgroups=1)),
                ("persistent 1 warpgroup c4", dict(compute_warpgroups=1, splits=4)),
                ("persistent kv64", dict(block_kv=64)), ("persistent kv256 s2", dict(block_kv=256, stages=2)),
                ("grid kv128 s4 c2 (one CTA per item)", dict(persistent=False))]
    for t in (4096, 16384):
        q, caches, sinks = decode_inputs(t)
        nbytes = 2.0 * b * t * hkv * d * 2 + 2 * q.nbytes
        runs = []
        for label, kw in variants:
            fn = lambda q, kv, cfg=DecodeConfig(**kw): decode_attention(q, *kv, sinks=sinks, config=cfg)
            runs.append((f"tessera {label}", lambda fn=fn: time_rotating(fn, (q,), caches * 5)))
        record_rounds(f"tune decode B{b} T{t}", runs, nbytes, "GB/s")
