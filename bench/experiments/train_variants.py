"""A train step's time with lowering variants patched in, one process, one after another (the state of one variant
is freed before the next compiles: two Llama-1B train states do not fit one card).

    python -m bench.experiments.train_variants [--spec specs/bench/llama_1b_train.yaml] [--set KEY=VALUE ...]
        [--only base,...] [--steps 5] [--checksum] [--hlo [--hlo-list] [--hlo-save DIR]]

Each variant replaces functions of the lowering while a fresh Program traces its train step (its first call), and is
timed as `tessera run`'s bench task times `train_step` (median of `--steps` calls after two warm-up calls). The
variants:
- "base": as built;
- "history only": delayed fp8 scaling from the amax history alone for every operand (an empty history: scale 1,
  Transformer Engine's initial scale), where the built form lets the gradient fall back to its current amax while
  its history is empty (at scale 1 a step-1 gradient underflows e5m2);
- "every operand falls back": the form built until session 33, every operand scaled from its current amax while its
  history is empty, a select that keeps each operand's amax reduction ahead of its cast;
- "barrier before weight gradient": the weight gradient's two fp8 operands behind an optimization barrier, so the
  transposes its GEMM needs are not fused into the fusions that quantise them (lowering_variants);
- "mlp products one by one": the MLP's gate and up as two fp8 products, each VJP quantising its own gradient after
  JAX differentiated SwiGLU (the form built until session 47; "base" runs them as one custom VJP whose backward
  forms and quantises both gradients at once: tessera/lower/fp8_mlp.py);
- "layers scanned": the stacked layers as one `lax.scan`, the form built until session 49 (now fast mode's step on
  one device unrolls them, tessera/lower/interpret.py `_unrolls_stacked`: no stacks of the residuals, which XLA:GPU
  fills by copies where a GEMM computed the value);
- "xla casts": the output gradients quantised by XLA's fusions of the references (an amax pass, then the casts and
  transposes) where the step runs the fp8_cast kernels (tessera/lower/kernels/fp8_cast.py, `kernels.FP8_CAST_IN_STEPS`:
  SwiGLU's two gradients and every other delayed product's output gradient as codes in both layouts with their amaxes,
  one pass);
- "xla casts mlp one by one": both, the form of session 45;
- "x rows apart": q, k and v (and gate and up, where the MLP is not fused) each scaling x by its own input row, the
  form built until session 51 (now by q's: equal rows, one cast of x that XLA shares; `ops_nn._shared_row`).
All but the barrier need a spec under `fp8_e4m3 @scale(delayed(H))`, the barrier any fp8 default, e.g.
`--set 'numerics.default=fp8_e4m3 @scale(delayed(16)) @accum(fp32)'`. Variant names hold no commas (`--only`).

Measured (session 33, one H100, jax 0.11.2, delayed(16), batch 8 x 2048; base then being "every operand falls back"
and "history only forward" today's built form): base 264.02 ms a step (loss after 9 steps learning one batch
0.2574), history only forward 249.87 (0.2945), history only 244.69 (2.7455: step 1's gradients underflowed).

Measured (session 48, one H200, jax 0.11.2, the spec above with the unembedding in fp8, the kernels then a variant):
XLA's casts 217.67 ms a step, the cast kernels 204.92 (1.062x), mlp products one by one 222.69; bf16 257.36 in the
same call. One H100, a call later: the kernels on, the scan 220.12 ms, layers unrolled 195.67 (1.125x, peak 35.4 ->
40.0 GiB); bf16 267.89 and unrolled 245.58 (1.091x, peak 34.8 -> 42.7 GiB). The peak was XLA's CSE merging each
layer's remat recomputation with its forward (session 49, the memory report: SwiGLU's product and the norms' outputs
kept for all 16 layers); with JAX's barrier on the recomputation (as built), one H100: bf16 scan 268.53 ms 34.8 GiB,
unrolled 261.04 ms 37.5 GiB (260.15 with each layer's backward also waiting on its cotangent); fp8 scan 219.13 ms
35.4 GiB, unrolled 203.16 ms 35.4 GiB (202.51).
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter

from tessera.run.environment import configure_allocator, configure_process

configure_allocator()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.experiments.lowering_variants import (  # noqa: E402
    barrier_before_weight_gradient, every_operand_falls_back, history_only, patched)
from tessera.lower import fp8_mlp, interpret, kernels, ops_nn  # noqa: E402
from tessera.lower.reference import fp8  # noqa: E402


_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) (\w[\w-]*)\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}


def _instructions(text: str):
    """(computation, line, `_DEF` match) of each instruction in an optimized HLO module's text, outside the
    computations a fusion calls; once per instruction (a loop body's once, however often the loop runs). ENTRY's
    computation is named "ENTRY <name>"."""
    fused = set(re.findall(r" fusion\(.*?calls=%([\w.-]+)", text))
    inside = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.-]+) ", line)
        if head and not line.startswith(" "):
            inside = ("ENTRY " if line.startswith("ENTRY") else "") + head.group(1)
        m = _DEF.match(line)
        if m and inside.removeprefix("ENTRY ") not in fused:
            yield inside, line, m


def _transposes(text: str):
    """(computation, instruction, result type) of each transpose (`_instructions`): `transpose` instructions and the
    fusions XLA names after one (`wrapped_transpose*`, `*_transpose_fusion*`)."""
    for inside, _, m in _instructions(text):
        if "transpose" in m.group(1) or m.group(3) == "transpose":
            yield inside, m.group(1), m.group(2)


def hlo_transpose_list(text: str, dtypes=("f8e4m3fn", "f8e5m2")) -> list[str]:
    """"computation: instruction type" of each transpose (`_transposes`) whose result holds one of `dtypes`."""
    return [f"{where}: {name} {kind}" for where, name, kind in _transposes(text) if any(d in kind for d in dtypes)]


def hlo_transposes(text: str) -> dict[str, tuple[int, int]]:
    """{element type: (instructions, bytes written)} of the transposes (`_transposes`), each array of a tuple result
    by its own type."""
    out: Counter = Counter()
    count: Counter = Counter()
    for _, _, kind in _transposes(text):
        for dtype, dims in _ARRAY.findall(kind):
            if dtype.startswith("s8") and kind.startswith("("):
                continue  # a custom call's workspace
            out[dtype] += _nbytes(dtype, dims)
            count[dtype] += 1
    return {k: (count[k], out[k]) for k in out}


_CALL = re.compile(r'custom_call_target="([^"]+)"')
_NAME = re.compile(r'\\?"(?:name|kernel_name)\\?"\s*:\s*\\?"([\w.$-]+)')
_OP_NAME = re.compile(r'op_name="(?:[^"]*/)?([^"/]+/[^"/]+)"')  # the last two scopes of the traced name
_MOVES = ("copy", "dynamic-slice", "dynamic-update-slice", "copy-start")


def hlo_calls(text: str) -> tuple[Counter, dict[str, tuple[int, int]]]:
    """In an optimized HLO module's text, outside fusions: ({(custom-call target, kernel name or ""): instructions},
    {opcode: (instructions, bytes of their results)} for the data moves XLA:GPU runs as copies of their own (`copy`,
    `dynamic-slice`, `dynamic-update-slice`: a layer's slice of a stacked array taken or written outside a fusion,
    the profile's MemcpyD2D), each instruction once (`_instructions`)."""
    calls: Counter = Counter()
    moves: dict[str, tuple[int, int]] = {}
    for _, line, m in _instructions(text):
        if m.group(3) == "custom-call":
            target = _CALL.search(line)
            name = _NAME.search(line) or _OP_NAME.search(line)  # a kernel's name, else where it was traced
            calls[(target.group(1) if target else "?", name.group(1) if name else "")] += 1
        elif m.group(3) in _MOVES:
            size = sum(_nbytes(dtype, dims) for dtype, dims in _ARRAY.findall(m.group(2)))
            n, b = moves.get(m.group(3), (0, 0))
            moves[m.group(3)] = (n + 1, b + size)
    return calls, moves


def _nbytes(dtype: str, dims: str) -> int:
    size = _BYTES.get(dtype, 1)
    for d in filter(None, dims.split(",")):
        size *= int(d)
    return size


VARIANTS = {
    "base": [],
    "history only": [(fp8, "quantize_delayed", history_only)],
    "every operand falls back": [(fp8, "quantize_delayed", every_operand_falls_back)],
    "barrier before weight gradient": [(fp8, "scaled_product", barrier_before_weight_gradient)],
    "mlp products one by one": [(fp8_mlp, "applies", lambda *args: False)],
    "layers scanned": [(interpret, "_unrolls_stacked", lambda *args: False)],
    "xla casts": [(kernels, "FP8_CAST_IN_STEPS", False)],
    "xla casts mlp one by one": [(kernels, "FP8_CAST_IN_STEPS", False),
                                    (fp8_mlp, "applies", lambda *args: False)],
    "x rows apart": [(ops_nn, "_shared_row", lambda *args: None)],
}


def main(argv=None, variants: dict = VARIANTS, overrides: tuple = (), description: str = __doc__,
         spec: str = "specs/bench/llama_1b_train.yaml") -> int:
    """Time each of `variants` ({name: patches}) on the spec (`--spec`, `spec` by default) with `overrides` before the
    person's `--set`s; other experiments (det_unrolled, det_cond) call it with their own and their spec. The peak
    device memory printed is the process's so far: one variant a process (`--only`) to compare it."""
    from tessera.lower import program
    from tessera.lower.program import compile_experiment
    from tessera.run.optim import build_optimizer, current_lr
    from tessera.run.tasks.bench import time_calls
    from tessera.spec import load_experiment

    ap = argparse.ArgumentParser(description=description.splitlines()[0])
    ap.add_argument("--spec", default=spec)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--only", default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--checksum", action="store_true", help="print each variant's final parameters' sha256")
    ap.add_argument("--hlo", action="store_true", help="print the transposes, custom calls and standalone copies in "
                    "each variant's compiled step")
    ap.add_argument("--hlo-list", action="store_true", help="with --hlo: each fp8 transpose, where and its type")
    ap.add_argument("--hlo-save", default=None, metavar="DIR", help="with --hlo: write each variant's compiled step "
                    "(HLO text) to DIR/<variant>.hlo.txt")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(variants)
    exp = load_experiment(args.spec, [*overrides, *args.set])
    configure_process(exp)  # before JAX starts its backend, as `tessera run` does (fp8: XLA's Triton GEMM off)
    b, s = int(exp.task.batch), int(exp.task.seq_len)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {args.spec} {args.set}, batch {b} x {s}", flush=True)
    tokens = np.random.default_rng(0).integers(0, compile_experiment(exp).vocab, (b, s), dtype=np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "mask": np.ones((b, s), np.float32)}
    times = {}
    for name in names:
        with patched(variants[name]):
            program._PROGRAMS.clear()  # a Program of its own: programs are cached on the spec's hash
            prog = compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)  # as `tessera run`
            holder = [prog.init_train_state(prog.init(0))]

            def step(prog=prog, holder=holder):
                holder[0], m = prog.train_step(holder[0], batch)
                return m["loss"]

            t = time_calls(step, 2, args.steps)
            loss = float(step())
            if args.checksum:  # the same steps from the same state: equal digests are the same bits
                from tessera.run.manifest import params_checksum

                print(f"{name:<24} parameters' sha256 {params_checksum(holder[0].params)}", flush=True)
            if args.hlo:  # the step as compiled (JAX's cached executable: no second compile)
                text = prog.lower("train_step", holder[0], batch).compile().as_text()
                found = hlo_transposes(text)
                if args.hlo_save:
                    os.makedirs(args.hlo_save, exist_ok=True)
                    with open(os.path.join(args.hlo_save, name.replace(" ", "_") + ".hlo.txt"), "w") as f:
                        f.write(text)
                if args.hlo_list:
                    print("\n".join(f"{name:<24} {t}" for t in hlo_transpose_list(text)), flush=True)
                print(f"{name:<24} transposes: " + (", ".join(f"{k} {n} ({b / 2 ** 30:.2f} GiB)"
                                                             for k, (n, b) in sorted(found.items())) or "none"),
                      flush=True)
                calls, moves = hlo_calls(text)
                print(f"{name:<24} custom calls: " + (", ".join(f"{t}{' ' + k if k else ''} x{n}"
                                                                for (t, k), n in sorted(calls.items())) or "none"),
                      flush=True)
                print(f"{name:<24} copies: " + (", ".join(f"{op} {n} ({b / 2 ** 30:.2f} GiB)"
                                                          for op, (n, b) in sorted(moves.items())) or "none"),
                      flush=True)
        del holder[:]  # the state freed before the next variant compiles
        times[name] = t["median_s"]
        stats = jax.devices()[0].memory_stats() or {}
        peak = f", peak {stats['peak_bytes_in_use'] / 2 ** 30:.1f} GiB" if "peak_bytes_in_use" in stats else ""
        print(f"{name:<24} {t['median_s'] * 1e3:8.2f} ms a step (spread {t['min_s'] * 1e3:.2f}-{t['max_s'] * 1e3:.2f}), "
              f"compile {t['compile_s']:.1f} s, loss after {args.steps + 4} steps {loss:.6f}{peak}", flush=True)
    for name in names:
        print(f"{name:<24} {times[names[0]] / times[name]:5.3f}x {names[0]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
