"""Flash attention against cuDNN, PyTorch SDPA and XLA: causal, full and window 128 + sinks, forward and
backward, head dims 64 and 128 (`python -m bench.kernels --only attention`); tune_attention times the
tile variants in turns (`--only tune`). TFLOP/s count visible (query, key) pairs; backward 2.5x the forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bench.timing import record, record_rounds, rel_err, time_jax, time_torch


def torch_sdpa_call(q, k, v, causal, backward):
    """A no-argument call of PyTorch SDPA on the same data ([B, H, S, D] layout, GQA): the
    forward, or the backward alone (autograd.grad of a graph retained here)."""
    import torch
    tq, tk, tv = (torch.from_dlpack(x).permute(0, 2, 1, 3).contiguous() for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not backward:
        def forward():
            with torch.no_grad():
                return sdpa(tq, tk, tv, is_causal=causal, enable_gqa=True)
        return forward
    for x in (tq, tk, tv):
        x.requires_grad_(True)
    out = sdpa(tq, tk, tv, is_causal=causal, enable_gqa=True)
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (tq, tk, tv), g, retain_graph=True)


def _torch_sdpa(q, k, v, causal, backward):
    """Milliseconds per call of PyTorch SDPA (torch_sdpa_call)."""
    return time_torch(torch_sdpa_call(q, k, v, causal, backward))


def attention_fns(causal: bool, window: int | None, sinks):
    """{"tessera": flash_attention, "cudnn": jax.nn.dot_product_attention} as f(q, k, v) for one
    mask (cuDNN takes no sinks)."""
    from tessera.lower.kernels.flash_attention import flash_attention
    return {
        "tessera": lambda q, k, v: flash_attention(q, k, v, sinks=sinks, causal=causal, window=window),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn",
            local_window_size=(window - 1, 0) if window else None),
    }


def _pullback(fn, q, k, v):
    """fn's VJP at (q, k, v), forward run once here: timing `pull(ct)` times the backward alone,
    as torch's row (autograd.grad of a retained graph) does."""
    _, pull = jax.vjp(jax.jit(fn), q, k, v)
    return pull


def _backward(pull, ct):
    return pull(ct)


def _attention_inputs(b, s, hq, hkv, d):
    """Random bf16 q [B,S,Hq,D], k, v [B,S,Hkv,D], an output cotangent and fp32 sinks [Hq]."""
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (b, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.bfloat16)
    ct = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
    return q, k, v, ct, jax.random.normal(ks[4], (hq,), jnp.float32)


def tune_attention(check: bool = False) -> None:
    """Tile variants (KV tile, ring depth, persistent grid or one CTA per item; backward tiles), checked."""
    from tessera.lower.kernels.flash_attention import FlashConfig, attention_flops, flash_attention
    from tessera.lower.reference.attention import attention as reference
    per_item = 1 << 30  # a grid of one CTA per work item: the non-persistent launch
    variants = {  # (head dim, causal, window, direction) -> [(label, FlashConfig kwargs)]
        (64, True, None, "fwd"): [("kv128 s4", dict(stages=4)), ("kv128 s3", dict(stages=3)),
                                  ("kv256 s2", dict(block_kv=256)),
                                  ("kv128 s4 per-item", dict(stages=4, num_ctas=per_item))],
        (64, True, 128, "fwd"): [("kv128 s4", dict(stages=4)), ("kv128 s2", dict()),
                                 ("kv128 s4 per-item", dict(stages=4, num_ctas=per_item))],
        (64, False, None, "fwd"): [("kv128 s4", dict(stages=4)), ("kv256 s2", dict(block_kv=256))],
        (128, True, None, "fwd"): [("kv128 s2", dict()), ("kv64 s4", dict(block_kv=64, stages=4))],
        (64, True, None, "bwd"): [(f"bwd q{a} kv{b}", dict(stages=4, block_q_bwd=a, block_kv_bwd=b))
                                  for a, b in ((128, 64), (64, 64), (64, 128), (128, 128))],
        (128, True, None, "bwd"): [(f"bwd q{a} kv{b}", dict(block_q_bwd=a, block_kv_bwd=b))
                                   for a, b in ((64, 64), (128, 64), (64, 128))],
    }
    for (d, causal, window, direction), cfgs in variants.items():
        b, s, hq, hkv = 4, 4096, 64 if d == 64 else 32, 8
        q, k, v, ct, sinks = _attention_inputs(b, s, hq, hkv, d)
        sk = sinks if window else None
        tag = f"B{b} S{s} H{hq}/{hkv} D{d} " + ("causal" if causal else "full")
        tag += f" w{window}+sinks" if window else ""
        flops = attention_flops(b, s, s, hq, d, causal=causal, window=window)
        ref = None
        if check and direction == "fwd":
            f32 = lambda x: x.astype(jnp.float32)
            ref = jax.jit(lambda q, k, v: reference(f32(q), f32(k), f32(v), sinks=sk, causal=causal,
                                                    window=window))(q, k, v)
        runs = []
        for label, kw in cfgs:
            cfg = FlashConfig(**kw)
            fn = lambda q, k, v, cfg=cfg: flash_attention(q, k, v, sinks=sk, causal=causal,
                                                          window=window, config=cfg)
            if ref is not None:
                try:
                    print(f"  check {tag} {label}: rel err {rel_err(jax.jit(fn)(q, k, v), ref):.2e}")
                except Exception as e:  # noqa: BLE001 - a variant that fails to build is reported
                    print(f"  check {tag} {label}: failed: {type(e).__name__}: {str(e)[:400]}")
                    continue
            if direction == "fwd":
                runs.append((f"tessera {label}", lambda fn=fn: time_jax(fn, q, k, v)))
            else:
                # one pullback a variant: a new one each round would be a new program to compile
                pull = functools.cache(functools.partial(_pullback, fn, q, k, v))
                runs.append((f"tessera {label}", lambda pull=pull: time_jax(_backward, pull(), ct)))
        record_rounds(f"tune {direction} {tag}", runs, flops * (1.0 if direction == "fwd" else 2.5))
        del ref


ATTENTION_SHAPES = {64: (4, 4096, 64, 8, 64), 128: (4, 4096, 32, 8, 128)}  # head dim: (B, S, Hq, Hkv, D)
HEAD_DIMS = tuple(ATTENTION_SHAPES)  # --head-dims: the attention rows to run (head dim 64 alone: 106 s on an H200)


def run_attention(check: bool = False) -> None:
    """Causal / full / window-128+sinks attention, forward and backward, head dims 64 and 128."""
    from tessera.lower.kernels.flash_attention import attention_flops
    from tessera.lower.reference.attention import attention as reference
    shapes = [ATTENTION_SHAPES[d] for d in HEAD_DIMS]
    for b, s, hq, hkv, d in shapes:
        q, k, v, ct, sinks = _attention_inputs(b, s, hq, hkv, d)
        for causal, window, sk in [(True, None, False), (False, None, False), (True, 128, True)]:
            tag = f"B{b} S{s} H{hq}/{hkv} D{d} " + ("causal" if causal else "full")
            tag += f" w{window}+sinks" if window else ""
            flops = attention_flops(b, s, s, hq, d, causal=causal, window=window)
            fns = attention_fns(causal, window, sinks if sk else None)
            ours, cudnn = fns["tessera"], fns["cudnn"]
            xla = lambda q, k, v: reference(q, k, v, causal=causal, window=window)
            if check:
                ref = reference(q[:1, :1024], k[:1, :1024], v[:1, :1024], sinks=sinks if sk else None,
                                causal=causal, window=window)
                got = ours(q[:1, :1024], k[:1, :1024], v[:1, :1024])
                err = rel_err(got, ref)
                print(f"  check {tag}: rel err {err:.2e}")
            for direction, mult in (("fwd", 1.0), ("bwd", 2.5)):
                case = f"attn {direction} {tag}"
                def timed(f):  # forward, or the backward alone (its forward run beforehand)
                    if direction == "fwd":
                        return lambda: time_jax(f, q, k, v)
                    return lambda: time_jax(_backward, _pullback(f, q, k, v), ct)
                record(case, "tessera (mosaic gpu)", timed(ours), flops * mult)
                record(case, "cuDNN (jax.nn.dpa)", timed(cudnn), flops * mult)
                if not window:
                    record(case, "torch SDPA", lambda: _torch_sdpa(q, k, v, causal, direction == "bwd"),
                           flops * mult)
                if s * s * hq * b * 4 <= 2**35 and direction == "fwd":
                    record(case, "XLA (jnp)", timed(xla), flops * mult)
