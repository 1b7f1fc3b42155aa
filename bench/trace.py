"""Device time per GPU kernel of one case, from a JAX profiler trace: where a call's time goes.

    python -m bench.trace decode [--t 4096] [--out DIR]
    python -m bench.trace decode --t 4096 --impl cudnn
    python -m bench.trace moe [--n 5760]
    python -m bench.trace copy

Runs the case's calls inside one program (bench.kernels.rotating_program) under `jax.profiler.trace`, then
reads the trace's GPU events and prints, per kernel name, the calls per case call, the mean
microseconds and the share of the GPU's busy time, and the busy time against the wall time.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import tempfile

import jax


def _gpu_events(trace_dir: pathlib.Path) -> list[dict]:
    """Complete events ('X') on the trace's GPU device rows (pids named /device:GPU:*)."""
    files = sorted(trace_dir.rglob("*.json.gz"))
    if not files:
        raise SystemExit(f"no trace under {trace_dir}: {sorted(p.name for p in trace_dir.rglob('*'))}")
    seen = set()
    for path in files:  # the profile plugin's trace and the perfetto one: the first with GPU rows
        data = json.loads(gzip.open(path).read())
        events = data["traceEvents"] if isinstance(data, dict) else data
        names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
        seen |= set(names.values())
        gpu = {pid for pid, n in names.items() if "gpu" in n.lower() and "host" not in n.lower()}
        found = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]
        if found:
            return found
    raise SystemExit(f"no GPU events in {[p.name for p in files]}; processes: {sorted(seen)}")


def report(events: list[dict], calls: int) -> None:
    by = collections.defaultdict(list)
    for e in events:
        by[e["name"]].append(e["dur"])
    busy = sum(sum(v) for v in by.values())
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    print(f"GPU busy {busy / calls:.1f} us per call over a span of {(end - start) / calls:.1f} us per call")
    for name, durs in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {len(durs) / calls:5.1f}x {sum(durs) / len(durs):9.1f} us {sum(durs) / busy:6.1%}  {name[:110]}")


def decode_case(t: int, impl: str = "tessera"):
    """Decode against four caches of t tokens: Tessera's kernel, or cuDNN (no sinks)."""
    from bench.kernels import decode_inputs
    from tessera.lower.kernels.decode_attention import decode_attention
    q, caches, sinks = decode_inputs(t)
    if impl == "cudnn":
        return (lambda q, kv: jax.nn.dot_product_attention(q, *kv, implementation="cudnn")), (q,), caches
    return (lambda q, kv: decode_attention(q, *kv, sinks=sinks)), (q,), caches


def copy_case():
    """x * 1.0001 over 4 different 512 MiB bf16 buffers: the device's copy bandwidth (bytes read + written)."""
    import jax.numpy as jnp
    xs = [jnp.full((2**28,), 1.5 + i, jnp.bfloat16) for i in range(4)]
    return (lambda x: x * 1.0001), (), xs


def moe_case(n: int):
    """The MoE forward of bench.kernels (32768 rows over 128 experts, 2880 -> n) over 4 routings."""
    import jax.numpy as jnp
    from bench.kernels import _routing_sizes
    from tessera.lower.kernels.grouped_matmul import grouped_matmul
    m, g, k = 32768, 128, 2880
    ks = jax.random.split(jax.random.key(1), 2)
    lhs = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    rhs = jax.random.normal(ks[1], (g, k, n), jnp.bfloat16) * 0.05
    sizes = [jnp.asarray(_routing_sizes(m, g, seed)) for seed in range(4)]
    return (lambda a, b, gs: grouped_matmul(a, b, gs)), (lhs, rhs), sizes


CASES = {"decode": lambda opts: decode_case(opts.t, opts.impl), "moe": lambda opts: moe_case(opts.n),
         "copy": lambda opts: copy_case()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--t", type=int, default=4096, help="decode: cache length")
    ap.add_argument("--n", type=int, default=5760, help="moe: output width")
    ap.add_argument("--impl", choices=["tessera", "cudnn"], default="tessera", help="decode: whose kernel")
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    from bench.kernels import rotating_program
    fn, consts, varying = CASES[opts.case](opts)
    many, args = rotating_program(fn, consts, varying)
    jax.block_until_ready(many(*args))  # compile and warm up
    out = pathlib.Path(opts.out or tempfile.mkdtemp())
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        jax.block_until_ready(many(*args))
    report(_gpu_events(out), calls=len(varying))


if __name__ == "__main__":
    main()
