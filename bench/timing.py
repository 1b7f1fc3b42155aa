"""The timing harness of the kernel benchmarks: how a call is timed, and the rows a run collects.

    from bench import timing
    timing.record(case, impl, lambda: timing.time_jax(fn, *args), flops)
    timing.print_table()

JAX calls are timed inside one program (time_in_program, time_rotating: the slope of a program's time
over more calls, so its fixed cost cancels), PyTorch calls between CUDA events (time_torch). Rows go to
ROWS as (case, implementation, ms, rate, unit); print_table prints them with Tessera / best peer.
TIMING and ROUNDS are set by `python -m bench.kernels` (--timing, --rounds) and read at call time.
The method and what it changed: docs/kernels-log.md, "Timing method".
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

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
    each round 184 against 225 us; docs/kernels-log.md, "Timing method"). A failing variant is printed and dropped.
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


def with_ratios(rows=None) -> list[tuple[tuple, float | None]]:
    """(row, Tessera / best peer) for each row, grouped by case in order of first appearance.

    The ratio is the row's rate over the best rate of a non-Tessera row of the same case; None for
    the peers themselves and for a case without peers. Rows default to ROWS."""
    rows = ROWS if rows is None else rows
    out = []
    for case in dict.fromkeys(r[0] for r in rows):
        group = [r for r in rows if r[0] == case]
        best = max((r[3] for r in group if not r[1].startswith("tessera")), default=None)
        out += [(r, r[3] / best if best and r[1].startswith("tessera") else None) for r in group]
    return out


def print_table() -> None:
    """One table: each case's rows, and Tessera / best peer."""
    print("\n| case | implementation | ms | rate | Tessera / best peer |\n|---|---|---|---|---|")
    for r, ratio in with_ratios():
        print(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.1f} {r[4]} | {f'{ratio:.2f}x' if ratio else ''} |")


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
