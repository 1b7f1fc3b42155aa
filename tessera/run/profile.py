"""`tessera profile SPEC`: a few steps of the spec's task under the JAX profiler, and where the time went.

    tessera profile specs/llama_1b.yaml --steps 3     # train step: forward, backward, optimizer per IR op
    tessera profile specs/gpt_oss_120b.yaml           # generate: prefill and decode per IR op

It prints three tables, each per step on one device: time per Graph IR op and phase (the lowering names
its HLO scopes after the op: `layers/attention`, `layers/moe`), next to the plan's time for that op (its
FLOPs over the device's peak or its bytes over the bandwidth, whichever is longer); time per kernel; and
per collective, the bytes each device sent, the time and the achieved bandwidth, next to the plan's bytes.
The trace is saved for Perfetto (ui.perfetto.dev) and TensorBoard; the manifest records it as `trace`
and the tables as `profile`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import numpy as np

from tessera.run import trace as tr

STEPS = 3
TOP = 15


@dataclasses.dataclass
class Job:
    """What one profiled step runs: `call` through the program's public API (as `tessera run` does), and the
    same jitted function (`key`) with its arguments (`args()`: current ones; `advance` threads a train step's
    state from each call's outputs)."""

    what: str
    call: Callable[[], Any]
    key: Callable[[], Any]
    args: Callable[[], tuple]
    advance: Callable[[Any], Any] = lambda out: out


def _job(prog, exp) -> Job:
    """The task's step on random tokens of the task's shapes."""
    import jax.numpy as jnp

    from tessera.ir.cost import task_dims
    from tessera.spec.tasks import trains

    task, sizes = exp.task, task_dims(exp)
    vocab = prog.vocab
    rng = np.random.default_rng(int(getattr(task, "seed", 0)))
    if task.kind == "generate":
        from tessera.run.tasks.generate import sampling_kwargs

        new = int(task.max_new_tokens)
        prompts = rng.integers(0, vocab, (sizes["batch"], sizes["seq"] - new), dtype=np.int32)
        params = prog.init(int(task.seed), split_layers=True)
        kw = {**sampling_kwargs(task), "stop_tokens": ()}  # every call decodes all max_new_tokens
        call = lambda: prog.generate(params, prompts, max_new_tokens=new, **kw)  # noqa: E731
        args = (params, jnp.asarray(prompts), jnp.asarray(kw["seed"], jnp.uint32), jnp.asarray(new, jnp.int32))
        return Job(f"generate ({prompts.shape[0]} x {prompts.shape[1]} prompt tokens, {new} new)", call,
                   lambda: prog.last_key, lambda: args)  # the key (it holds the sampling rule) once called
    b, s = sizes["batch"], sizes["seq"]
    tokens = rng.integers(0, vocab, (b, s), dtype=np.int32)
    params = prog.init(int(getattr(task, "seed", 0)))
    if prog.optimizer is not None and trains(task) and prog.graph.losses:
        return _loss_entries_job(prog, exp, params, rng)
    if prog.optimizer is not None and trains(task):
        batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "mask": np.ones((b, s), np.float32)}
        return _train_job(prog, params, batch, f"{b} x {s} tokens")
    tokens = jnp.asarray(tokens, jnp.int32)
    return Job(f"forward ({b} x {s} tokens)", lambda: prog.forward(params, tokens), lambda: "forward",
               lambda: (params, tokens))


def _loss_entries_job(prog, exp, params, rng) -> Job:
    """The train step of a model trained on its loss entries, on random inputs of the shapes the task's data gives
    them (a collocation set's points, the data batch: `cost.loss_sizes`)."""
    from tessera.ir.cost import loss_inputs, loss_sizes
    from tessera.lower.context import jnp_dtype

    inputs = loss_inputs(loss_sizes(prog.graph, exp))
    batch = {k: rng.standard_normal(shape).astype(np.dtype(jnp_dtype(dtype))) for k, (shape, dtype) in inputs.items()}
    return _train_job(prog, params, batch, ", ".join(f"{k} {'x'.join(map(str, shape))}"
                                                     for k, (shape, _) in inputs.items()))


def _train_job(prog, params, batch: dict, what: str) -> Job:
    """One optimizer step of `batch` (host arrays, placed as the program's global batch), the state carried."""
    batch = prog.global_batch(batch)
    holder = [prog.init_train_state(params)]

    def step():
        holder[0], metrics = prog.train_step(holder[0], batch)
        return metrics["loss"]

    def advance(out):
        holder[0] = out[0]
        return out[1]["loss"]

    return Job(f"train step ({what})", step, lambda: "train_step", lambda: (holder[0], batch), advance)


# XLA on a GPU replays a step's kernels as CUDA graphs ("command buffers"), and the trace then names the
# graph, not the instruction, for each kernel: the profiled executable is compiled without them.
GPU_PROFILE_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


def _profiled_executable(prog, job: Job, say):
    """(the executable the trace runs, its optimized HLO text, a note on how it differs from the run's)."""
    import jax

    lowered = prog.lower(job.key(), *job.args())
    if jax.default_backend() == "gpu":
        try:
            compiled = lowered.compile(compiler_options=GPU_PROFILE_OPTIONS)
            return compiled, compiled.as_text(), "compiled again without CUDA graphs, so each kernel names its op"
        except Exception as exc:  # an XLA that does not know the option: attribute what the trace names
            say(f"profile: could not compile without CUDA graphs ({str(exc).splitlines()[0][:120]})")
    compiled = lowered.compile()
    return compiled, compiled.as_text(), None


# ---- the plan's side ----------------------------------------------------------------------------------------

def _phases(exp, train: bool) -> list[tuple[str, dict, int]]:
    """(phase, sizes, times per step) of what one profiled step runs."""
    from tessera.ir.cost import task_dims
    from tessera.spec.tasks import trains

    sizes = task_dims(exp)
    if exp.task.kind == "generate":
        new = int(exp.task.max_new_tokens)
        return [("prefill", {"batch": sizes["batch"], "seq": sizes["seq"] - new}, 1),
                ("decode", {"batch": sizes["batch"], "seq": 1}, new - 1)]
    return [("forward", sizes, 1)] + ([("backward", sizes, 1)] if train else [])


def predicted(exp, graph, train: bool, device) -> dict[tuple[str, str], float]:
    """The plan's seconds per step for each (phase, IR op) on one device of `device` (tessera.run.plan.Device).

    An op takes max(FLOPs / peak, bytes / bandwidth): FLOPs from the IR (backward: 2x a contraction's,
    1x the rest), bytes the parameter bytes it reads (a decode step reads only the experts its tokens
    visit, and attention its KV cache; backward reads them again and writes their gradients). The
    optimizer reads and writes every parameter and its state once. Nothing when the device's peak or
    bandwidth is unknown (the CPU)."""
    from tessera.ir import cost
    from tessera.ir.flops import op_flops
    from tessera.ir.registry import get_op
    from tessera.run.plan import optimizer_states

    if not (device.peak_flops and device.bandwidth):
        return {}
    layout = cost.Layout.of(exp)
    n, out = layout.devices, {}
    param_bytes = {p.path: layout.per_device(p.type) * cost.bits_per_element(p.type.dtype) / 8
                   for p in graph.params.values()}
    max_len = cost.task_dims(exp)["seq"]
    for phase, sizes, times in _phases(exp, train):
        for label, op, axes, reps in cost.walk_labeled(graph.body):
            opdef = get_op(op.name)
            flops = reps * op_flops(op, graph, sizes, list(axes)) / n
            touched = (lambda a: 1.0 - (1.0 - a) ** sizes["batch"]) if phase == "decode" else (lambda a: 1.0)
            read = sum(param_bytes[path] * touched(opdef.active_fraction(op.attrs, name))
                       for path, name in cost.param_uses(op))
            if phase == "decode":
                read += cost.op_kv_cache_bytes(op, reps, sizes["batch"], max_len, layout.activations)
            if phase == "backward":
                flops *= 2.0 if opdef.contraction else 1.0
                read *= 2.0
            key = (phase, label)
            out[key] = out.get(key, 0.0) + times * max(flops / device.peak_flops, read / device.bandwidth)
    if train:
        states = optimizer_states(exp)
        numel = sum(layout.per_device(p.type) for p in graph.params.values())
        moved = sum(param_bytes.values()) * 2 + numel * 4 * (2 * states + 1)  # params r/w, states r/w, grads r
        out[("optimizer", "optimizer")] = moved / device.bandwidth
    return out


# ---- the run ------------------------------------------------------------------------------------------------

def profile_experiment(exp, *, steps: int = STEPS, out: str | Path | None = None, top: int = TOP,
                       overrides: Any = None, spec_file: str | Path | None = None,
                       stream: TextIO | None = None) -> dict:
    """Profile `steps` steps of `exp`'s task into a run directory; returns its manifest record."""
    from tessera.run.main import RUNS_DIR, exclusive, prepare

    stream = stream or sys.stdout
    say = lambda text: print(text, file=stream, flush=True)  # noqa: E731
    exp, allocator, mesh_choice = prepare(exp, say)
    stamp = f"{_dt.datetime.now():%Y%m%d-%H%M%S}-{exp.spec_hash[:8]}"
    run_dir = Path(out) if out else RUNS_DIR / f"{exp.name}-profile-{stamp}"
    with exclusive(run_dir):  # as `tessera run`: one run writes a directory at a time
        record = _profile_in(run_dir, exp, steps, top, overrides, spec_file, allocator, mesh_choice, say, stream)
    say(f"manifest: {run_dir / 'manifest.json'}")
    return record


def _profile_in(run_dir: Path, exp, steps: int, top: int, overrides, spec_file, allocator: dict,
                mesh_choice: dict | None, say, stream: TextIO) -> dict:
    """`profile_experiment` once it holds its run directory."""
    import jax

    from tessera.run.main import default_compile, recorded
    from tessera.run.manifest import Manifest, device_memory
    from tessera.run.plan import pick_device

    manifest = Manifest.start(run_dir, exp, ir_hash=None, seed=int(getattr(exp.task, "seed", 0)), overrides=overrides,
                              spec_file=Path(spec_file).resolve() if spec_file else None,
                              extra={"run_dir": str(run_dir), "weights": None, "allocator": allocator,
                                     "mesh_choice": mesh_choice, "command": "profile"})
    with recorded(manifest):
        prog = default_compile(exp)
        manifest.update(ir_hash=prog.ir_hash)
        job = _job(prog, exp)
        start = time.perf_counter()
        jax.block_until_ready(job.call())
        first = time.perf_counter() - start
        wall = []
        for _ in range(steps):  # the step as `tessera run` runs it
            start = time.perf_counter()
            jax.block_until_ready(job.call())
            wall.append(time.perf_counter() - start)
        executable, hlo_text, note = _profiled_executable(prog, job, say)
        run = lambda: job.advance(executable(*job.args()))  # noqa: E731
        jax.block_until_ready(run())
        trace_dir = run_dir / "trace"
        times = []
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            for _ in range(steps):
                start = time.perf_counter()
                jax.block_until_ready(run())
                times.append(time.perf_counter() - start)
        (trace_dir / "profiled.hlo.txt").write_text(hlo_text)  # what the trace ran, metadata and all
        hlo = tr.parse_hlo(hlo_text)
        path = tr.trace_file(trace_dir)
        events = tr.read_events(path, tr.module_name(hlo_text), hlo) if path else []
        labels, param_labels = _labels(prog.graph)
        what, train = job.what, job.what.startswith("train step")
        key, device = pick_device(None)
        plan = predicted(exp, prog.graph, train, device)
        ops = tr.by_op(events, hlo, labels, steps, param_labels)
        for row in ops:
            row["plan_seconds"] = plan.get((row["phase"], row["op"]))
        collectives = tr.by_collective(events, hlo, steps)
        _add_planned_collectives(collectives, exp, prog.graph, train)
        record = {"what": what, "steps": steps, "step_seconds": statistics.median(wall),
                  "traced_step_seconds": statistics.median(times), "traced": note, "first_call_seconds": first,
                  "device": key, "devices_traced": tr.device_count(events),
                  "hlo": str(trace_dir / "profiled.hlo.txt"),
                  "op_seconds": sum(r["seconds"] for r in ops), "plan_seconds": sum(plan.values()) or None,
                  "by_op": ops, "by_kernel": tr.by_kernel(events, hlo, labels, steps, param_labels)[:100],
                  "by_collective": collectives}
        manifest.update(profile=record, trace=str(path) if path else str(trace_dir), device_memory=device_memory())
        render(record, stream, top)
        say(f"trace: {path or trace_dir} (open in ui.perfetto.dev, or TensorBoard's profile plugin on {trace_dir})")
    return manifest.record


def _labels(graph) -> tuple[list[str], dict[str, str]]:
    """(every IR op's label, with `loss` and `optimizer`; {parameter path: the label of the op that reads it})."""
    from tessera.ir.cost import param_uses, walk_labeled

    labels, owners = ["loss", "optimizer"], {}
    for label, op, _, _ in walk_labeled(graph.body):
        labels.append(label)
        for path, _ in param_uses(op):
            owners.setdefault(path, label)
    return labels, owners


def _add_planned_collectives(rows: list[dict], exp, graph, train: bool) -> None:
    """Each measured collective kind gets the plan's bytes per step for it (`plan_bytes_per_step`), and the
    kinds the plan expects but the trace lacks get a row of their own."""
    from tessera.ir import cost

    sizes = cost.task_dims(exp)
    if exp.task.kind == "generate":
        sizes = {"batch": sizes["batch"], "seq": 1}
    planned: dict[str, float] = {}
    for r in cost.collectives(graph, sizes, cost.Layout.of(exp), train=train, remat=exp.parallel.remat):
        for kind in r["kind"].split("+"):
            planned[kind] = planned.get(kind, 0.0) + r["bytes"] / len(r["kind"].split("+"))
    for row in rows:
        row["plan_bytes_per_step"] = planned.pop(row["kind"], None)
    rows += [{"kind": k, "seconds": 0.0, "calls": 0.0, "bytes_per_step": 0.0, "bandwidth_bytes_per_s": None,
              "plan_bytes_per_step": b} for k, b in planned.items()]


# ---- the report -----------------------------------------------------------------------------------------

def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:,.3f}"


def _bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:,.2f} {unit}"
    return f"{b:,.0f} B"


def render(record: dict, stream: TextIO, top: int = TOP) -> None:
    """The three tables of a profile record, each per step on one device."""
    say = lambda text="": print(text, file=stream)  # noqa: E731
    total = record["op_seconds"] or 1e-30
    say(f"profile: {record['what']}, {record['steps']} steps; step {_ms(record['step_seconds'])} ms wall "
        f"(median; traced {_ms(record['traced_step_seconds'])} ms), device time {_ms(record['op_seconds'])} ms "
        f"per step on one device" + (f", plan {_ms(record['plan_seconds'])} ms" if record["plan_seconds"] else ""))
    if record.get("traced"):
        say(f"traced executable: {record['traced']}")
    say()
    say(f"{'Graph IR op':<34} {'phase':<9} {'ms/step':>10} {'share':>6} {'plan ms':>9} {'x plan':>7} {'calls':>7}")
    for r in record["by_op"][:max(top, 1) * 2]:
        ratio = f"{r['seconds'] / r['plan_seconds']:.1f}" if r.get("plan_seconds") else "-"
        say(f"{r['op'][:34]:<34} {r['phase']:<9} {_ms(r['seconds']):>10} {r['seconds'] / total:>6.1%} "
            f"{_ms(r.get('plan_seconds')):>9} {ratio:>7} {r['calls']:>7.0f}")
    say()
    say(f"{'kernel':<48} {'ms/step':>10} {'share':>6} {'calls':>7} {'us/call':>8}  IR op (phase)")
    for r in record["by_kernel"][:top]:
        each = f"{r['seconds'] / r['calls'] * 1e6:,.1f}" if r["calls"] else "-"
        say(f"{r['kernel'][:48]:<48} {_ms(r['seconds']):>10} {r['seconds'] / total:>6.1%} {r['calls']:>7.0f} "
            f"{each:>8}  {r['op']} ({r['phase']})")
    if record["by_collective"]:
        say()
        say(f"{'collective':<20} {'calls':>7} {'sent/step':>12} {'ms/step':>10} {'GB/s':>8} {'plan sent':>12}")
        for r in record["by_collective"]:
            bw = r.get("bandwidth_bytes_per_s")
            say(f"{r['kind']:<20} {r['calls']:>7.0f} {_bytes(r['bytes_per_step']):>12} {_ms(r['seconds']):>10} "
                f"{(f'{bw / 1e9:,.1f}' if bw else '-'):>8} {_bytes(r.get('plan_bytes_per_step')):>12}")


def profile_command(spec: str, overrides=(), steps: int = STEPS, out: str | None = None, top: int = TOP) -> int:
    """The `tessera profile` command; returns the exit code."""
    from tessera.spec import load_experiment

    exp = load_experiment(spec, overrides=list(overrides or ()))
    profile_experiment(exp, steps=steps, out=out, top=top, overrides=list(overrides or ()), spec_file=spec)
    return 0
