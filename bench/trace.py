"""Device time per GPU kernel of one case, from a JAX profiler trace: where a call's time goes.

    python -m bench.trace decode [--t 4096] [--out DIR]
    python -m bench.trace decode --t 4096 --impl cudnn
    python -m bench.trace moe [--n 5760]
    python -m bench.trace copy
    python -m bench.trace mxfp4 [--t 1] [--n 2880] [--g 32]
    python -m bench.trace generate [--spec specs/gpt_oss_20b.yaml] [--t 16]

Runs the case's calls inside one program (bench.timing.rotating_program) under `jax.profiler.trace`, then
reads the trace's GPU events and prints, per kernel name, the calls per case call, the mean
microseconds and the share of the GPU's busy time, and the busy time against the wall time.
`generate` traces a whole model's generation instead (random weights): one call with --t new tokens
and one with a single new token, and prints the difference per generated token, i.e. one decode step.
Run it with `XLA_FLAGS=--xla_gpu_enable_command_buffer=`: profiling the token loop as a CUDA graph
crashed the process (jax 0.11.2, H200); without graphs the kernels are the same, the gaps longer. Add
`--xla_gpu_deterministic_ops=true` to see the program `tessera run` runs (deterministic: true).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import tempfile

import jax


def _gpu_events(trace_dir: pathlib.Path) -> list[dict]:
    """Complete events ('X') on the trace's GPU device rows (pids named /device:GPU:*)."""
    files = sorted(trace_dir.rglob("*.json.gz"))
    if not files:
        raise SystemExit(f"no trace under {trace_dir}: {sorted(p.name for p in trace_dir.rglob('*'))}")
    from tessera.run.trace import load

    seen = set()
    for path in files:  # the profile plugin's trace and the perfetto one: the first with GPU rows
        events, names, _ = load(path)
        seen |= set(names.values())
        gpu = {pid for pid, n in names.items() if "gpu" in n.lower() and "host" not in n.lower()}
        found = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]
        if found:
            return found
    raise SystemExit(f"no GPU events in {[p.name for p in files]}; processes: {sorted(seen)}")


def profile_us(fn, consts, varying, out: pathlib.Path | None = None, breakdown: bool = False
               ) -> tuple[float, float]:
    """(GPU busy us, span us) per call of fn(*consts, v) over `varying`, from a profile of one program
    running the calls back to back (bench.timing.rotating_program), compiled and warmed up first;
    `breakdown` prints the time per kernel too."""
    from bench.timing import rotating_program
    many, args = rotating_program(fn, consts, varying)
    jax.block_until_ready(many(*args))
    out = pathlib.Path(tempfile.mkdtemp(dir=out))  # a fresh directory: never an older run's trace
    with jax.profiler.trace(str(out)):
        jax.block_until_ready(many(*args))
    events = _gpu_events(out)
    if breakdown:
        report(events, calls=len(varying))
    return sum(e["dur"] for e in events) / len(varying), _span(events) / len(varying)


def _span(events: list[dict]) -> float:
    return max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)


def report(events: list[dict], calls: int, base: list[dict] = (), top: int | None = None) -> None:
    """Per kernel name: launches and mean us per call, share of the busy time; `base` (a trace of
    the same program doing one call's less work) is subtracted name by name first."""
    by = collections.defaultdict(lambda: [0, 0.0])
    for sign, evs in ((1, events), (-1, base)):
        for e in evs:
            by[e["name"]][0] += sign
            by[e["name"]][1] += sign * e["dur"]
    busy = sum(d for _, d in by.values())
    span = _span(events) - (_span(base) if base else 0.0)
    print(f"GPU busy {busy / calls:.1f} us per call over a span of {span / calls:.1f} us per call")
    rows = sorted(((n, c, d) for n, (c, d) in by.items() if c or d), key=lambda r: -r[2])
    for name, count, dur in rows[:top]:
        mean = dur / count if count else 0.0
        print(f"  {count / calls:5.1f}x {mean:9.1f} us {dur / busy:6.1%}  {name[:110]}")
    if top is not None and len(rows) > top:
        rest = sum(r[2] for r in rows[top:])
        print(f"  ({len(rows) - top} other kernels: {rest / calls:.1f} us per call, {rest / busy:.1%})")


def decode_case(t: int, impl: str = "tessera"):
    """Decode against four caches of t tokens: Tessera's kernel, or cuDNN (no sinks)."""
    from bench.suites.decode import decode_inputs
    from tessera.lower.kernels.decode_attention import decode_attention
    q, caches, sinks = decode_inputs(t)
    if impl == "cudnn":
        return (lambda q, kv: jax.nn.dot_product_attention(q, *kv, implementation="cudnn")), (q,), caches
    return (lambda q, kv: decode_attention(q, *kv, sinks=sinks)), (q,), caches


def copy_case():
    """The copy bench.kernels takes as the memory ceiling (four 512 MiB bf16 buffers)."""
    from bench.timing import copy_case as case
    return case()


def moe_case(n: int):
    """The MoE forward of bench.kernels (32768 rows over 128 experts, 2880 -> n) over 4 routings."""
    import jax.numpy as jnp
    from bench.suites.moe import _routing_sizes
    from tessera.lower.kernels.grouped_matmul import grouped_matmul
    m, g, k = 32768, 128, 2880
    ks = jax.random.split(jax.random.key(1), 2)
    lhs = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    rhs = jax.random.normal(ks[1], (g, k, n), jnp.bfloat16) * 0.05
    sizes = [jnp.asarray(_routing_sizes(m, g, seed)) for seed in range(4)]
    return (lambda a, b, gs: grouped_matmul(a, b, gs)), (lhs, rhs), sizes


def mxfp4_case(tokens: int, n: int, g: int):
    """The MXFP4 expert matmul at decode (tokens x top-4 rows, 2880 -> n over g experts), 8 routings."""
    import jax.numpy as jnp
    from bench.suites.mxfp4 import _decode_routings, _mxfp4_experts
    from tessera.lower.kernels.mxfp4_matmul import ragged_dot
    rhs = _mxfp4_experts(g, 2880, n)
    lhs = jax.random.normal(jax.random.key(0), (tokens * 4, 2880), jnp.bfloat16)
    sizes = [jnp.asarray(s) for s in _decode_routings(tokens, 4, g, count=8)]
    return (lambda a, b, gs: ragged_dot(a, b, gs)), (lhs, rhs), sizes


def generate_trace(spec: str, new: int, out: pathlib.Path, overrides=(), top: int = 40) -> None:
    """One model's decode step, kernel by kernel: generate(new) minus generate(1), per new token.

    The program is the one `tessera run` compiles for the spec (greedy, the spec's token-id prompts,
    no stop tokens), with random weights; the XLA flags are the caller's (see the module docstring).
    """
    if new < 2:
        raise SystemExit(f"generate needs --t >= 2 new tokens (got {new}): a step is generate(t) - generate(1)")
    import time

    import numpy as np

    from tessera.lower.program import compile_experiment
    from tessera.spec import load_experiment

    exp = load_experiment(spec, overrides=list(overrides))
    prog = compile_experiment(exp)
    params = jax.block_until_ready(prog.init(seed=exp.task.seed))
    ids = np.asarray(exp.task.prompts, np.int32)  # token-id prompts of one length
    gen = lambda n: jax.block_until_ready(prog.generate(params, ids, max_new_tokens=n))  # noqa: E731
    walls = {}
    for n in (new, 1):
        t0 = time.perf_counter()
        gen(n)
        print(f"generate({n}) first call (compiles): {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        for _ in range(3):
            gen(n)
        walls[n] = (time.perf_counter() - t0) / 3
    step = (walls[new] - walls[1]) / (new - 1)
    print(f"{spec}: {step * 1e3:.3f} ms per decode step (wall), {ids.shape[0] / step:.1f} tokens/s", flush=True)
    traces = {}
    for n in (new, 1):
        where = pathlib.Path(tempfile.mkdtemp(prefix=f"gen{n}-", dir=out))  # never an older run's trace
        with jax.profiler.trace(str(where), create_perfetto_trace=True):
            gen(n)
        traces[n] = _gpu_events(where)
    report(traces[new], calls=new - 1, base=traces[1], top=top)
    print("kernel implementations:", json.dumps(prog.kernel_report(), indent=1))


CASES = {"decode": lambda opts: decode_case(opts.t, opts.impl), "moe": lambda opts: moe_case(opts.n),
         "copy": lambda opts: copy_case(), "mxfp4": lambda opts: mxfp4_case(opts.t, opts.n, opts.g)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=sorted(CASES) + ["generate"])
    ap.add_argument("--t", type=int, default=None,
                    help="decode: cache length (4096); mxfp4: tokens (1); generate: new tokens (16)")
    ap.add_argument("--n", type=int, default=None, help="moe: output width (5760); mxfp4: (2880)")
    ap.add_argument("--g", type=int, default=32, help="mxfp4: experts")
    ap.add_argument("--spec", default="specs/gpt_oss_20b.yaml", help="generate: the experiment")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="generate: spec overrides")
    ap.add_argument("--impl", choices=["tessera", "cudnn"], default="tessera", help="decode: whose kernel")
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    defaults = {"decode": (4096, None), "moe": (None, 5760), "mxfp4": (1, 2880), "generate": (16, None)}
    t, n = defaults.get(opts.case, (None, None))
    opts.t, opts.n = opts.t or t, opts.n or n
    out = pathlib.Path(opts.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    if opts.case == "generate":
        return generate_trace(opts.spec, opts.t, out, opts.set)
    profile_us(*CASES[opts.case](opts), out=out, breakdown=True)


if __name__ == "__main__":
    main()
