"""Times Tessera's GPU kernels against their peers on the same shapes in one run; prints one table.

    python -m bench.kernels [--only attention,moe,decode] [--check]

Peers: XLA (jnp reference), cuDNN through jax.nn.dot_product_attention, PyTorch SDPA and
torch._grouped_mm, lax.ragged_dot, a padded batched einsum. TFLOP/s count only the work needed
(visible pairs for attention, real rows for grouped GEMM); decode reports GB/s against the
measured copy bandwidth. The ratio column is Tessera / best peer on the same row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROWS: list[tuple[str, str, float, float, str]] = []  # (case, impl, ms, rate, unit)


def time_jax(fn, *args, iters: int = 20) -> float:
    """Median milliseconds of fn(*args) (jitted, warmed up, synchronised per call)."""
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def time_torch(fn, iters: int = 20) -> float:
    """Median milliseconds of fn() with CUDA events."""
    import torch
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| in fp32."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def record(case: str, impl: str, run, work: float, unit: str = "TFLOP/s") -> None:
    """Time `run()` (returns ms), store the row; failures are printed and skipped."""
    try:
        ms = run()
    except Exception as e:  # a peer missing on this machine must not hide the others
        print(f"  {case} / {impl}: failed: {type(e).__name__}: {str(e)[:300]}")
        return
    scale = 1e12 if unit == "TFLOP/s" else 1e9
    ROWS.append((case, impl, ms, work / (ms * 1e-3) / scale, unit))
    print(f"  {case:<44} {impl:<26} {ms:9.3f} ms {ROWS[-1][3]:9.1f} {unit}", flush=True)


def print_table() -> None:
    """One table: each case's rows, and Tessera / best peer."""
    print("\n| case | implementation | ms | rate | Tessera / best peer |\n|---|---|---|---|---|")
    for case in dict.fromkeys(r[0] for r in ROWS):
        rows = [r for r in ROWS if r[0] == case]
        ours = [r for r in rows if r[1].startswith("tessera")]
        peers = [r for r in rows if not r[1].startswith("tessera")]
        best = max((r[3] for r in peers), default=None)
        for r in rows:
            ratio = f"{r[3] / best:.2f}x" if (best and r in ours) else ""
            print(f"| {case} | {r[1]} | {r[2]:.3f} | {r[3]:.1f} {r[4]} | {ratio} |")


# ----------------------------------------------------------------------------- attention


def _torch_sdpa(q, k, v, causal, backward):
    """PyTorch SDPA on the same data ([B, H, S, D] layout, GQA)."""
    import torch
    tq, tk, tv = (torch.from_dlpack(x).permute(0, 2, 1, 3).contiguous() for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not backward:
        with torch.no_grad():
            return time_torch(lambda: sdpa(tq, tk, tv, is_causal=causal, enable_gqa=True))
    for x in (tq, tk, tv):
        x.requires_grad_(True)
    out = sdpa(tq, tk, tv, is_causal=causal, enable_gqa=True)
    g = torch.randn_like(out)
    return time_torch(lambda: torch.autograd.grad(out, (tq, tk, tv), g, retain_graph=True))


def _grad_fn(fn):
    """(q, k, v, ct) -> grads of <fn(q, k, v), ct>: times the backward (and its forward)."""
    def g(q, k, v, ct):
        out, vjp = jax.vjp(fn, q, k, v)
        return vjp(ct.astype(out.dtype))
    return g


def _attention_inputs(b, s, hq, hkv, d):
    """Random bf16 q [B,S,Hq,D], k, v [B,S,Hkv,D], an output cotangent and fp32 sinks [Hq]."""
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (b, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.bfloat16)
    ct = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
    return q, k, v, ct, jax.random.normal(ks[4], (hq,), jnp.float32)


def tune_attention(check: bool = False) -> None:
    """Forward/backward tile variants on the GPT-OSS shape (causal and window 128 + sinks)."""
    from tessera.lower.kernels.flash_attention import FlashConfig, attention_flops, flash_attention
    b, s, hq, hkv, d = 4, 4096, 64, 8, 64
    q, k, v, ct, sinks = _attention_inputs(b, s, hq, hkv, d)
    fwd_cfgs = [FlashConfig(block_kv=bkv, stages=st) for bkv, st in [(64, 4), (128, 2), (256, 2)]]
    bwd_cfgs = [FlashConfig(block_q_bwd=a, block_kv_bwd=c, stages=st)
                for a, c, st in [(64, 128, 2), (128, 64, 2), (64, 64, 3)]]
    for window in (None, 128):
        tag = f"B{b} S{s} H{hq}/{hkv} D{d} causal" + (f" w{window}+sinks" if window else "")
        flops = attention_flops(b, s, s, hq, d, causal=True, window=window)
        for cfg in fwd_cfgs:
            fn = lambda q, k, v, cfg=cfg: flash_attention(q, k, v, sinks=sinks if window else None,
                                                          window=window, config=cfg)
            record(f"tune fwd {tag}", f"tessera bkv={cfg.block_kv} st={cfg.stages}",
                   lambda: time_jax(fn, q, k, v), flops)
        for cfg in bwd_cfgs:
            fn = lambda q, k, v, cfg=cfg: flash_attention(q, k, v, sinks=sinks if window else None,
                                                          window=window, config=cfg)
            record(f"tune bwd {tag}", f"tessera bq={cfg.block_q_bwd} bkv={cfg.block_kv_bwd} st={cfg.stages}",
                   lambda: time_jax(_grad_fn(fn), q, k, v, ct), 2.5 * flops)


def run_attention(check: bool = False) -> None:
    """Causal / full / window-128+sinks attention, forward and backward, head dims 64 and 128."""
    from tessera.lower.kernels.flash_attention import attention_flops, flash_attention
    from tessera.lower.reference.attention import attention as reference
    shapes = [(4, 4096, 64, 8, 64), (4, 4096, 32, 8, 128)]
    for b, s, hq, hkv, d in shapes:
        q, k, v, ct, sinks = _attention_inputs(b, s, hq, hkv, d)
        for causal, window, sk in [(True, None, False), (False, None, False), (True, 128, True)]:
            tag = f"B{b} S{s} H{hq}/{hkv} D{d} " + ("causal" if causal else "full")
            tag += f" w{window}+sinks" if window else ""
            flops = attention_flops(b, s, s, hq, d, causal=causal, window=window)
            ours = lambda q, k, v: flash_attention(q, k, v, sinks=sinks if sk else None,
                                                   causal=causal, window=window)
            cudnn = lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn",
                local_window_size=(window - 1, 0) if window else None)
            xla = lambda q, k, v: reference(q, k, v, causal=causal, window=window)
            if check:
                ref = reference(q[:1, :1024], k[:1, :1024], v[:1, :1024], sinks=sinks if sk else None,
                                causal=causal, window=window)
                got = ours(q[:1, :1024], k[:1, :1024], v[:1, :1024])
                err = rel_err(got, ref)
                print(f"  check {tag}: rel err {err:.2e}")
            for direction, mult in (("fwd", 1.0), ("bwd", 2.5)):
                case = f"attn {direction} {tag}"
                wrap = (lambda f: f) if direction == "fwd" else _grad_fn
                args = (q, k, v) if direction == "fwd" else (q, k, v, ct)
                record(case, "tessera (mosaic gpu)", lambda: time_jax(wrap(ours), *args), flops * mult)
                record(case, "cuDNN (jax.nn.dpa)", lambda: time_jax(wrap(cudnn), *args), flops * mult)
                if not window:
                    record(case, "torch SDPA", lambda: _torch_sdpa(q, k, v, causal, direction == "bwd"),
                           flops * mult)
                if s * s * hq * b * 4 <= 2**35 and direction == "fwd":
                    record(case, "XLA (jnp)", lambda: time_jax(wrap(xla), *args), flops * mult)


# ----------------------------------------------------------------------------- MoE grouped GEMM


def _routing_sizes(m: int, g: int, seed: int = 0, empty: int = 0) -> np.ndarray:
    """Group sizes of m rows routed at random over g experts (the last `empty` experts get none)."""
    ids = np.random.default_rng(seed).integers(0, g - empty, m)
    return np.bincount(ids, minlength=g).astype(np.int32)


def _torch_grouped_mm(lhs, rhs, sizes, backward: bool):
    """torch._grouped_mm on the same data (rhs as [G, N, K] transposed: its fast layout)."""
    import torch
    a = torch.from_dlpack(lhs)
    b = torch.from_dlpack(rhs).transpose(-2, -1).contiguous().transpose(-2, -1)
    offs = torch.from_dlpack(jnp.cumsum(jnp.asarray(sizes)).astype(jnp.int32))
    if not backward:
        return time_torch(lambda: torch._grouped_mm(a, b, offs=offs))
    a.requires_grad_(True)
    b.requires_grad_(True)
    out = torch._grouped_mm(a, b, offs=offs)
    g = torch.randn_like(out)
    return time_torch(lambda: torch.autograd.grad(out, (a, b), g, retain_graph=True))


def run_moe(check: bool = False) -> None:
    """GPT-OSS expert GEMM: 32768 rows, 128 experts, 2880 -> 5760 (and 2880 -> 2880), fwd / bwd."""
    from tessera.lower.kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
    for m, g, k, n, empty in [(32768, 128, 2880, 5760, 0), (32768, 128, 2880, 2880, 16)]:
        sizes = _routing_sizes(m, g, empty=empty)
        ks = jax.random.split(jax.random.key(1), 3)
        lhs = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
        rhs = jax.random.normal(ks[1], (g, k, n), jnp.bfloat16) * 0.05
        ct = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
        gs = jnp.asarray(sizes)
        flops = 2.0 * m * k * n
        tag = f"M{m} G{g} {k}->{n}" + (f" ({empty} empty)" if empty else "")
        if check:
            got = grouped_matmul(lhs[:4096], rhs, jnp.asarray(_routing_sizes(4096, g, 1)))
            want = grouped_matmul_reference(lhs[:4096], rhs, jnp.asarray(_routing_sizes(4096, g, 1)))
            err = rel_err(got, want)
            print(f"  check {tag}: rel err {err:.2e}")
        cap = int(-(-sizes.max() // 128) * 128)
        rows = np.concatenate([np.arange(s) + o for s, o in zip(sizes, np.cumsum(sizes) - sizes)])
        slot = np.concatenate([np.arange(s) + i * cap for i, s in enumerate(sizes)])

        def padded(lhs, rhs):  # scatter into [G, cap, K], batched einsum, gather back
            buf = jnp.zeros((g * cap, k), lhs.dtype).at[slot].set(lhs[rows]).reshape(g, cap, k)
            out = jnp.einsum("gck,gkn->gcn", buf, rhs, preferred_element_type=jnp.float32)
            return out.reshape(g * cap, n)[slot].astype(lhs.dtype)

        ours = lambda a, b: grouped_matmul(a, b, gs)
        ragged = lambda a, b: grouped_matmul_reference(a, b, gs)
        for direction, mult in (("fwd", 1.0), ("fwd+bwd", 3.0)):
            case = f"moe {direction} {tag}"
            if direction == "fwd":
                wrap, args = (lambda f: f), (lhs, rhs)
            else:
                def wrap(f):
                    def fb(a, b, c):
                        out, vjp = jax.vjp(f, a, b)
                        return out, vjp(c)
                    return fb
                args = (lhs, rhs, ct)
            record(case, "tessera (mosaic gpu)", lambda: time_jax(wrap(ours), *args), flops * mult)
            record(case, "torch._grouped_mm", lambda: _torch_grouped_mm(lhs, rhs, sizes, direction != "fwd"),
                   flops * mult)
            record(case, "padded batched einsum", lambda: time_jax(wrap(padded), *args), flops * mult)
            if direction == "fwd":
                record(case, "lax.ragged_dot (XLA)", lambda: time_jax(wrap(ragged), *args, iters=3),
                       flops * mult)


def run_dense(check: bool = False) -> None:
    """Dense GEMM 8192^3 bf16: the peers' matrix-unit ceiling on this GPU (no Tessera kernel)."""
    import torch
    a = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    record("dense GEMM 8192^3", "XLA (jnp.dot)", lambda: time_jax(jnp.dot, a, a), 2.0 * 8192**3)
    ta = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    record("dense GEMM 8192^3", "torch.mm", lambda: time_torch(lambda: ta @ ta), 2.0 * 8192**3)


# ----------------------------------------------------------------------------- decode


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (bytes read + written) of a 4 GiB buffer: the memory ceiling."""
    x = jnp.ones((2**31 // 2,), jnp.bfloat16) * 1.5  # 2 GiB
    ms = time_jax(lambda a: a * 1.0001, x, iters=10)
    return 2 * x.nbytes / (ms * 1e-3) / 1e9


def run_decode(check: bool = False) -> None:
    """One query token per sequence against caches of 4k-64k tokens (GQA 64/8, D 64), GB/s."""
    from tessera.lower.kernels.decode_attention import decode_attention, decode_attention_reference
    ceiling = copy_bandwidth()
    ROWS.append(("memory ceiling (copy)", "jnp copy", 0.0, ceiling, "GB/s"))
    print(f"  copy bandwidth {ceiling:.0f} GB/s")
    b, hq, hkv, d = 8, 64, 8, 64
    for t, window in [(4096, None), (16384, None), (65536, None), (65536, 128)]:
        ks = jax.random.split(jax.random.key(t), 4)
        q = jax.random.normal(ks[0], (b, 1, hq, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, t, hkv, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, t, hkv, d), jnp.bfloat16)
        sinks = jax.random.normal(ks[3], (hq,), jnp.float32)
        keys = t if window is None else window
        nbytes = 2.0 * b * keys * hkv * d * 2 + 2 * q.nbytes
        case = f"decode B{b} T{t} H{hq}/{hkv} D{d}" + (f" w{window}" if window else "") + " sinks"
        ours = lambda q, k, v: decode_attention(q, k, v, sinks=sinks, window=window)
        xla = lambda q, k, v: decode_attention_reference(q, k, v, sinks=sinks, window=window)
        if check:
            got, want = ours(q, k, v), xla(q, k, v)
            err = rel_err(got, want)
            print(f"  check {case}: rel err {err:.2e}")
        record(case, "tessera (mosaic gpu)", lambda: time_jax(ours, q, k, v), nbytes, "GB/s")
        record(case, "XLA (jnp)", lambda: time_jax(xla, q, k, v), nbytes, "GB/s")
        if window is None:
            cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
            record(case, "cuDNN (jax.nn.dpa, no sinks)", lambda: time_jax(cudnn, q, k, v), nbytes, "GB/s")
        ours_rate = [r[3] for r in ROWS if r[0] == case and r[1].startswith("tessera")]
        if ours_rate:
            print(f"  {case}: tessera at {ours_rate[0] / ceiling:.0%} of the copy ceiling", flush=True)


# ----------------------------------------------------------------------------- main


def main() -> None:
    """Run the selected groups and print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="attention,moe,decode,dense")
    ap.add_argument("--check", action="store_true")
    opts = ap.parse_args()
    print(f"devices: {jax.devices()}  jax {jax.__version__}")
    groups = {"attention": run_attention, "moe": run_moe, "dense": run_dense, "tune": tune_attention,
              "decode": run_decode}
    for name in opts.only.split(","):
        if name in groups:
            groups[name](check=opts.check)
    print_table()


if __name__ == "__main__":
    main()
