"""Times Tessera's GPU kernels against their peers on the same shapes in one run; prints one table.

    python -m bench.kernels [--only attention,moe,decode] [--check] [--head-dims 64] [--rounds 3]

Peers: XLA (jnp reference), cuDNN through jax.nn.dot_product_attention, PyTorch SDPA and
torch._grouped_mm, lax.ragged_dot, a padded batched einsum. TFLOP/s count only the work needed
(visible pairs for attention, real rows for grouped GEMM); decode reports GB/s against the
measured copy bandwidth. The ratio column is Tessera / best peer on the same row.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROWS: list[tuple[str, str, float, float, str]] = []  # (case, impl, ms, rate, unit)


TIMING = "program"  # or "dispatch" (--timing): how time_jax times a call, see there
ROUNDS = 3  # --rounds: how many times tune / tune_decode time each variant, in turns (record_rounds)


def time_jax(fn, *args, iters: int = 20, reps: int = 5) -> float:
    """Median device milliseconds per call of fn(*args) (jitted, warmed up).

    "dispatch" timing: a sample issues `iters` calls of the jitted function back to back and
    waits for the last (JAX dispatches asynchronously). Each call is then one program execution,
    and each execution carries a fixed cost (on an H100 about 0.15 ms for the MoE forward: its
    profiled GPU time was 2.36 ms a call, dispatch timing gave 2.51-2.55).
    "program" timing (default): the calls run inside one program, as a model's step runs its
    kernels, and the time per call is the slope over 2 and more calls (time_in_program): the
    program's fixed cost cancels, the gaps between the calls' kernels stay in. PyTorch rows
    (back-to-back launches between CUDA events) measure the same thing. Calls longer than 20 ms
    (lax.ragged_dot) keep dispatch timing: the fixed cost is under 1% of them.
    """
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = f(*args)  # the previous output is freed once its call has run
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    ms = statistics.median(times) * 1e3
    if TIMING == "dispatch" or ms > 20.0:
        return ms
    return time_in_program(fn, *args, calls=(2, 2 + _extra_calls(fn, args, ms)))


_EXTRA_CALLS: dict = {}  # (fn, its arguments' structure and shapes) -> extra calls of its long program


def _extra_calls(fn, args, ms: float) -> int:
    """Calls the long timing program adds for ~40 ms of GPU time (host jitter of ~0.1 ms a program
    then moves the slope by < 1%), as long as their outputs, all kept, fit in 16 GiB. Fixed by the
    first timing of fn on these arguments: a count that followed each round's jitter of `ms`
    would be a new program, compiled again."""
    key = (fn, jax.tree.structure(args), tuple((x.shape, x.dtype) for x in jax.tree.leaves(args)))
    if key not in _EXTRA_CALLS:
        out_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(fn, *args)))
        _EXTRA_CALLS[key] = min(max(4, math.ceil(40.0 / ms)), 48, max(4, int(16 * 2**30 // max(out_bytes, 1))))
    return _EXTRA_CALLS[key]


def time_in_program(fn, *args, calls: tuple[int, int] = (2, 6), reps: int = 7) -> float:
    """Device ms per call of fn(*args) inside one program: the slope of its time over `calls` calls.

    Every call's output is returned, so none is dead code; the optimization barrier chaining
    the calls (rotating_program) keeps XLA from merging them. Each program's time is the fastest
    of `reps` runs (host jitter only adds time). The programs are compiled on the first call for
    `fn` and reused after it: timing rounds of the same function compile once.
    """
    ticks = [jnp.int32(i) for i in range(calls[1])]
    return _slope_ms(_tick_ignored(fn), args, ticks[:calls[0]], ticks, reps)


@functools.cache
def _tick_ignored(fn):
    """fn taking one more, ignored argument (the call index), one wrapper per fn: see _rotating."""
    return lambda *a: fn(*a[:-1])


def time_torch(fn, iters: int = 20, reps: int = 5) -> float:
    """Median milliseconds per call of fn(): `iters` back-to-back calls between two CUDA events."""
    import torch
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| in fp32."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def record(case: str, impl: str, run, work: float, unit: str = "TFLOP/s") -> None:
    """Time `run()` (returns ms), store the row; failures are printed and skipped."""
    record_rounds(case, [(impl, run)], work, unit, rounds=1)


def record_rounds(case: str, variants, work: float, unit: str = "TFLOP/s", *, rounds: int | None = None) -> None:
    """Time `variants` [(impl, run)] in turns, `rounds` times (--rounds), and store each one's median.

    Variants of a kernel differ by a few percent, and so does one build between processes and over
    minutes (H200, window 128 + sinks: 182-235 us in separate processes, 191-204 us in one). A
    variant timed once after another is compared with the machine's drift; timed in turns, within
    one process, each round sees the same machine. Odd rounds run the variants in reverse: on an
    H200 a fixed order biased one comparison by 20% (two identical window kernels, the second of
    each round 184 against 225 us; bench/RESULTS.md). A failing variant is printed and dropped.
    """
    rounds = ROUNDS if rounds is None else rounds
    times: dict[str, list[float]] = {impl: [] for impl, _ in variants}
    for r in range(rounds):
        for impl, run in (variants if r % 2 == 0 else variants[::-1]):
            if impl not in times:
                continue
            try:
                times[impl].append(run())
            except Exception as e:  # a peer missing on this machine must not hide the others
                print(f"  {case} / {impl}: failed: {type(e).__name__}: {str(e)[:300]}")
                del times[impl]
    scale = 1e12 if unit == "TFLOP/s" else 1e9
    for impl, ms in times.items():
        med = statistics.median(ms)
        ROWS.append((case, impl, med, work / (med * 1e-3) / scale, unit))
        spread = f"  ({min(ms):.3f}-{max(ms):.3f} over {len(ms)} rounds)" if len(ms) > 1 else ""
        print(f"  {case:<44} {impl:<26} {med:9.3f} ms {ROWS[-1][3]:9.1f} {unit}{spread}", flush=True)


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
                                 ("kv128 s4 per-item", dict(stages=4, num_ctas=per_item)),
                                 ("kv128 s4 band", dict(stages=4, band=True))],
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
    g = torch.randn_like(torch._grouped_mm(a, b, offs=offs))
    # forward + backward, as the Tessera row (jax.vjp then the pullback) times it
    return time_torch(lambda: torch.autograd.grad(torch._grouped_mm(a, b, offs=offs), (a, b), g))


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
    from bench.moe_variants import fused_rows
    fused_rows()  # gate/up GEMM + clamped SwiGLU, fused vs unfused


def run_dense(check: bool = False) -> None:
    """Dense GEMM 8192^3 bf16: the peers' matrix-unit ceiling on this GPU (no Tessera kernel)."""
    import torch
    a = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    record("dense GEMM 8192^3", "XLA (jnp.dot)", lambda: time_jax(jnp.dot, a, a), 2.0 * 8192**3)
    ta = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    record("dense GEMM 8192^3", "torch.mm", lambda: time_torch(lambda: ta @ ta), 2.0 * 8192**3)


# ----------------------------------------------------------------------------- decode


def _scaled_copy(x):
    return x * 1.0001  # bf16: x * 1, which XLA runs as one MemcpyD2D


def copy_case():
    """(fn, consts, varying) of the memory ceiling: a copy of one of four 512 MiB buffers a call
    (L2 serves none of it), as `fn(*consts, v)` for bench.trace.profile_us."""
    return _scaled_copy, (), [jnp.full((2**28,), 1.5 + i, jnp.bfloat16) for i in range(4)]


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (bytes read + written): the memory ceiling the decode rows are held to.

    The copy's GPU busy time from a profile (bench.trace.profile_us): one MemcpyD2D a call, on an
    H200 256 us for 512 MiB, 4190 GB/s, as torch's `Tensor.copy_` (4190-4240). Timed by the slope
    of a program's time instead, the same copies measured 2270-2320 GB/s, and one 2 GiB buffer timed
    with time_jax 2400-2500: both below cuDNN's decode (4280 GB/s), so ratios against them read
    72-138%.
    """
    from bench.trace import profile_us
    fn, consts, xs = copy_case()
    busy_us, _ = profile_us(fn, consts, xs)
    return 2 * xs[0].nbytes / (busy_us * 1e-6) / 1e9


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
    ROWS.append(("memory ceiling (copy)", "jnp copy", 0.0, ceiling, "GB/s"))
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
        ours_rate = [r[3] for r in ROWS if r[0] == case and r[1].startswith("tessera")]
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


# ----------------------------------------------------------------------------- MXFP4 experts, RMSNorm


def rotating_program(fn, consts, varying):
    """A jitted program running fn(*consts, v) for each v of `varying` back to back, and its arguments.

    An optimization barrier between calls makes each depend on the last, so XLA cannot merge the
    calls' dots into one (which it does for dots sharing an operand). The program is one jitted
    function per `fn`, so timing `fn` again (another round) reuses its compiled executables; and
    `fn` is a jitted call inside it, traced and lowered once however many calls the program makes
    (a Mosaic GPU kernel takes ~0.3 s to lower, at every call site of a plain function).
    """
    return _rotating(fn), (consts, varying)


@functools.cache
def _rotating(fn):
    fn = jax.jit(fn)  # XLA inlines it: the program runs the same kernels as with fn unrolled

    def many(c, vs):
        outs = []
        for v in vs:
            outs.append(fn(*c, v))
            c, _ = jax.lax.optimization_barrier((c, outs[-1]))
        return outs
    return jax.jit(many)


def _program_ms(fn, consts, varying, iters: int) -> float:
    """Fastest wall ms of `iters` executions of rotating_program (compiled and warmed up first)."""
    many, args = rotating_program(fn, consts, varying)
    jax.block_until_ready(many(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(many(*args))
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def _slope_ms(fn, consts, short, long, iters: int) -> float:
    """ms each call adds to a program: (time over `long` - time over `short`) / the extra calls."""
    extra = _program_ms(fn, consts, long, iters) - _program_ms(fn, consts, short, iters)
    return max(extra, 0.0) / (len(long) - len(short))


def time_rotating(fn, consts, varying, iters: int = 20) -> float:
    """Device ms per call of fn(*consts, v) for decode-sized calls (~10-500 us): the slope of a program's time.

    One program runs the calls back to back over the `varying` inputs (other caches, routings or
    activations, so L2 cannot serve a repeated operand); a second runs them three times over. The
    difference divided by the extra calls is the time each call adds to a long program: the
    program's fixed cost (launch, argument handling, the host's wait for the result) cancels;
    the gaps between the calls' kernels stay in. For calls of ~30 us host jitter still moves this
    by several percent: `python -m bench.trace decode` reads the device time from a profile.
    """
    return _slope_ms(fn, consts, varying, list(varying) * 3, iters)


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
    ROWS.append(("memory ceiling (copy)", "jnp copy", 0.0, ceiling, "GB/s"))
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
            ours = [r[3] for r in ROWS if r[0] == case and r[1].startswith("tessera")]
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
            ROWS.append((case, f"tessera {label}", busy / 1e3, nbytes / (busy * 1e-6) / 1e9, "GB/s"))
            print(f"  {case:<30} {label:<24} busy {busy:7.1f} us  span {span:7.1f} us "
                  f"{ROWS[-1][3]:7.0f} GB/s{err}", flush=True)
        del rhs


def run_rms_norm(check: bool = False) -> None:
    """x + r -> RMSNorm * scale (GPT-OSS width 2880), fused kernel vs XLA's fusion, GB/s of the minimal traffic.

    fwd (+residual) moves 4 tensors (x, r in; y, h out), fwd+bwd 8 (+ h, dy, dh in; dh out; random
    cotangents), plain RMSNorm fwd 2 (what the `rmsnorm` op lowers to).
    """
    from tessera.lower.kernels.rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm
    from tessera.lower.reference.norms import rms_norm as rms_norm_reference
    d = 2880
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.key(5), (d,), jnp.float32)
    for rows in (4096, 32768):
        xs = [jax.random.normal(jax.random.key(i), (rows, d), jnp.bfloat16) for i in range(4)]
        r, cy, ch = (jax.random.normal(jax.random.key(9 + i), (rows, d), jnp.bfloat16) for i in range(3))
        tensor = rows * d * 2
        if check:
            got, want = add_rms_norm(xs[0], r, scale, eps=1e-5)[0], add_rms_norm_reference(xs[0], r, scale, eps=1e-5)[0]
            print(f"  check rmsnorm {rows}x{d}: rel err {rel_err(got, want):.2e}")
        plain = [("tessera rmsnorm (pallas triton)", rms_norm),
                 ("XLA fusion (jnp)", lambda x, s, eps: rms_norm_reference(x, scale=s, eps=eps))]
        for name, fn in plain:
            record(f"rmsnorm fwd {rows}x{d}", name,
                   lambda: time_rotating(lambda s, x, fn=fn: fn(x, s, eps=1e-5), (scale,), xs), 2 * tensor, "GB/s")
        for name, fn in [(plain[0][0], add_rms_norm), (plain[1][0], add_rms_norm_reference)]:
            fwd = lambda r, s, x, fn=fn: fn(x, r, s, eps=1e-5)
            record(f"rmsnorm+residual fwd {rows}x{d}", name, lambda: time_rotating(fwd, (r, scale), xs),
                   4 * tensor, "GB/s")

            def fwd_bwd(r, s, cy, ch, x, fn=fn):
                out, vjp = jax.vjp(lambda x, r, s: fn(x, r, s, eps=1e-5), x, r, s)
                return vjp((cy, ch))
            record(f"rmsnorm+residual fwd+bwd {rows}x{d}", name,
                   lambda: time_rotating(fwd_bwd, (r, scale, cy, ch), xs), 8 * tensor, "GB/s")


# ----------------------------------------------------------------------------- main


def main() -> None:
    """Run the selected groups and print the table."""
    global TIMING, HEAD_DIMS, ROUNDS
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="attention,moe,decode,dense")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--timing", choices=["program", "dispatch"], default="program",
                    help="JAX rows: calls inside one program (default) or one program per call")
    ap.add_argument("--head-dims", default="64,128", help="attention rows: head dims 64 and/or 128")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="tune and tune_decode: time each variant this many times, in turns, and keep the median")
    opts = ap.parse_args()
    if opts.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {opts.rounds}")
    TIMING, ROUNDS = opts.timing, opts.rounds
    HEAD_DIMS = tuple(int(d) for d in opts.head_dims.split(","))
    if not set(HEAD_DIMS) <= set(ATTENTION_SHAPES):
        ap.error(f"--head-dims takes {sorted(ATTENTION_SHAPES)}, got {opts.head_dims}")
    print(f"devices: {jax.devices()}  jax {jax.__version__}  timing: {TIMING}")
    groups = {"attention": run_attention, "moe": run_moe, "dense": run_dense, "tune": tune_attention,
              "decode": run_decode, "mxfp4": run_mxfp4, "rmsnorm": run_rms_norm,
              "tune_mxfp4": tune_mxfp4, "tune_decode": tune_decode}
    for name in opts.only.split(","):
        if name in groups:
            groups[name](check=opts.check)
    print_table()


if __name__ == "__main__":
    main()
