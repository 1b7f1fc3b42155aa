"""`tessera run`: pick the run directory, compile, run the task, and keep the manifest true throughout.

    result = run_experiment(exp, out="runs/x")      # Python
    tessera run specs/x.yaml --set task.steps=100   # command line → run_command
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TextIO

import yaml

from tessera.diagnostics import RunError, TesseraError
from tessera.run.checkpoint import check_compatible
from tessera.run.compiletime import CACHE_VAR, cache_counts, cache_record, configure_compilation_cache
from tessera.run.environment import AUTOTUNE_VAR, autotune_record, configure_process
from tessera.run.context import RunContext
from tessera.run.manifest import MANIFEST, Manifest, load_manifest
from tessera.run.metrics import MetricsLog
from tessera.spec.files import file_records

RUNS_DIR = Path("runs")
SPEC_FILE = "spec.yaml"
OOM_MARKERS = ("resource_exhausted", "out of memory")  # matched in the lower-cased error text


@dataclasses.dataclass
class RunResult:
    """What a run left behind: its directory, final manifest record and exit code."""

    run_dir: Path
    manifest: dict[str, Any]
    exit_code: int

    @property
    def metrics(self) -> list[dict]:
        return self.manifest["metrics"]

    @property
    def params_checksum(self) -> str | None:
        return self.manifest["params_checksum"]

    @property
    def status(self) -> str:
        return self.manifest["status"]


def describe_allocator(record: dict) -> tuple[dict, str | None]:
    """(the record with each accelerator's usable bytes added, a line to print on an accelerator, else None)."""
    import jax

    from tessera.run.manifest import device_memory

    limit = (device_memory() or {}).get("bytes_limit")
    if not limit:
        return record, None
    dev = jax.local_devices()[0]
    record = {**record, "bytes_limit": limit}
    who = "tessera set" if record["set_by"] == "tessera" else "you set"
    what = ", ".join(f"{k}={v}" for k, v in record.items() if k.startswith("XLA_"))
    return record, (f"memory: JAX may use {limit / 2 ** 30:,.1f} GiB of each {dev.device_kind} ({who} {what}"
                    + ("; set XLA_PYTHON_CLIENT_MEM_FRACTION to choose otherwise)" if who == "tessera set" else ")"))


def resolve_mesh(exp, say) -> tuple[Any, dict | None]:
    """(exp on a concrete mesh, the manifest's `mesh_choice` record or None): `mesh: auto` picks one from the
    devices present and the plan (tessera/run/automesh.py) and says which and why; an explicit mesh stays."""
    mesh = getattr(exp, "mesh", None)
    if mesh is None:
        return exp, None
    if not mesh.auto or mesh.size > 1:  # explicit, or chosen already (a manifest's spec)
        return exp, _explicit_mesh(mesh, say)
    from tessera.run.automesh import choose_mesh, usable_memory

    memory, devices, kind = usable_memory()
    choice = choose_mesh(exp, devices, memory)
    mesh = " ".join(f"{a}={n}" for a, n in choice.exp.mesh.axes.items() if n > 1) or "one device"
    say(f"mesh: auto -> {mesh} on {devices} x {kind}: {choice.reason}")
    return choice.exp, choice.record()


def _explicit_mesh(mesh, say) -> dict | None:
    """A written mesh smaller than the devices present runs on the first mesh.size of them: said, and recorded
    under `mesh_choice` (None when it uses them all, is one device, or is too big: `build_mesh` refuses that)."""
    import jax

    present = len(jax.devices())
    if not 1 < mesh.size < present or jax.process_count() > 1:
        return None
    axes = {a: n for a, n in mesh.axes.items() if n > 1}
    shown = " ".join(f"{a}={n}" for a, n in axes.items())
    say(f"mesh: {shown} uses {mesh.size} of the {present} devices present, as written (the other "
        f"{present - mesh.size} stay idle; `mesh: auto` or a product of {present} would use them)")
    return {"auto": False, "mesh": axes, "devices_present": present, "devices_used": mesh.size,
            "reason": "the spec's mesh, smaller than the devices present"}


def jax_backend() -> str:
    import jax

    return jax.default_backend()


def prepare(exp, say) -> tuple[Any, dict, dict | None]:
    """Before JAX starts its backend: the allocator and deterministic-kernel settings (said when on a GPU),
    then the mesh `mesh: auto` picks. Returns (exp on that mesh, the `allocator` and `mesh_choice` records)."""
    records = configure_process(exp)  # the command line did this before importing JAX; a Python caller gets it here
    autotune = records["autotune_cache"]
    allocator, line = describe_allocator(records["allocator"])
    if line:
        say(line)
        if autotune["set_by"] == "tessera" and autotune["dir"] and jax_backend() == "gpu":
            say(f"GPU kernel choices (XLA's autotuning) are kept in {autotune['dir']}, so every compile of a program "
                f"on this machine takes the same kernels (set {AUTOTUNE_VAR}=off to stop, or to a directory to move "
                f"them)")
        fp8 = records["fp8_gemms"]
        if fp8 and fp8["set_by"] == "tessera" and jax_backend() == "gpu":
            say(f"fp8 products: {' '.join(fp8['flags'])} (cuBLASLt's fp8 GEMMs: the step is faster and compiles in "
                f"seconds where XLA's Triton tilings took minutes; name the flag in XLA_FLAGS to choose otherwise)")
    cache = configure_compilation_cache()
    if cache["set_by"] == "tessera":
        say(f"compiled programs are kept in {cache['dir']} for the next run (set {CACHE_VAR}=off to stop, "
            f"or to a directory to move them)")
    exp, mesh_choice = resolve_mesh(exp, say)
    return exp, allocator, mesh_choice


def default_compile(exp):
    """The program for `exp` (Graph IR → JAX); a train task's carries the optimizer `tessera.run.optim` builds."""
    from tessera.lower.program import compile_experiment
    from tessera.run.optim import build_optimizer, current_lr

    if exp.task.kind in ("train", "bench"):
        return compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)
    return compile_experiment(exp)


def default_run_dir(exp, when: _dt.datetime | None = None) -> Path:
    """runs/<name>-<YYYYmmdd-HHMMSS>-<first 8 of the spec hash>/ under the working directory."""
    when = when or _dt.datetime.now()
    return RUNS_DIR / f"{exp.name}-{when:%Y%m%d-%H%M%S}-{exp.spec_hash[:8]}"


def latest_run_dir(exp) -> Path | None:
    """The newest run directory of this spec (same name and hash) that holds a manifest, if any."""
    found = sorted(RUNS_DIR.glob(f"{exp.name}-*-{exp.spec_hash[:8]}/{MANIFEST}"))
    return found[-1].parent if found else None


def _choose_dir(exp, out, resume: bool) -> tuple[Path, bool]:
    """(run directory, whether to continue from its checkpoints)."""
    if out is not None:
        out = Path(out)
        return out, resume or (out / MANIFEST).exists()  # re-running into the same --out continues
    if resume:
        prev = latest_run_dir(exp)
        if prev is not None:
            return prev, True
    return default_run_dir(exp), False


def _start_manifest(run_dir: Path, exp, overrides, spec_file, weights, resuming: bool) -> Manifest:
    """Continue the directory's manifest when resuming into it, else start a new one (ir_hash follows)."""
    extra = {"run_dir": str(run_dir), "weights": str(weights) if weights else None}
    if resuming and (run_dir / MANIFEST).exists():
        record = load_manifest(run_dir)
        record.update(spec=exp.resolved(), spec_hash=exp.spec_hash, files=file_records(exp.resolved()), status="running", error=None, ended_at=None,
                      **extra)
        record.setdefault("resumed", [])
        manifest = Manifest(run_dir, record)
        manifest.flush()
        return manifest
    return Manifest.start(run_dir, exp, ir_hash=None, seed=int(exp.task.seed), overrides=overrides,
                          spec_file=spec_file, extra=extra)


LOCK = ".lock"


@contextlib.contextmanager
def exclusive(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir` for this process: a second run writing the same directory at the same time is refused
    (RunError) before it touches anything. The lock is the OS's (flock) on `run_dir/.lock`: a run that dies
    releases it with its process, so a killed run's directory can be resumed at once."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise RunError(f"{run_dir} is being written by another tessera run ({holder}); wait for it to end, "
                           "or give this run another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, started {_dt.datetime.now():%Y-%m-%d %H:%M:%S}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def recorded(manifest: Manifest, cached: dict | None = None) -> Iterator[None]:
    """Record how the block ends in the manifest; a runtime out-of-memory becomes a plain RunError. `cached`:
    `cache_counts()` before the block, to record the programs it loaded from the persistent cache."""
    try:
        yield
        if cached is not None:
            manifest.update(compilation_cache=cache_record(cached), autotune_cache=autotune_record())
        if manifest.record["status"] == "running":
            manifest.finish("completed")
    except (TesseraError, RunError) as exc:
        manifest.finish("failed", error=str(exc))
        raise
    except KeyboardInterrupt:
        manifest.finish("interrupted", error="interrupted")
        raise
    except Exception as exc:  # a runtime failure of a valid spec
        manifest.finish("failed", error=f"{type(exc).__name__}: {exc}")
        if any(m in str(exc).lower() for m in OOM_MARKERS):
            raise RunError(f"out of memory on {manifest.record['backend']}: {str(exc).splitlines()[0][:300]}; "
                           "reduce task.batch or task.seq_len, raise task.microbatches, or use more devices") from None
        raise


def run_experiment(exp, out: str | Path | None = None, *, weights: str | Path | None = None, resume: bool = False,
                   overrides: Any = None, spec_file: str | Path | None = None,
                   compile_fn: Callable[[Any], Any] | None = None, stream: TextIO | None = None,
                   tensorboard: bool = True) -> RunResult:
    """Run `exp`'s task into a run directory (default runs/<name>-<time>-<hash>/) and return what it left.
    Two runs never write one directory at once: the second is refused (`exclusive`)."""
    say = lambda text: print(text, file=stream or sys.stdout, flush=True)  # noqa: E731
    exp, allocator, mesh_choice = prepare(exp, say)
    run_dir, resuming = _choose_dir(exp, out, resume)
    with exclusive(run_dir):
        return _run_in(run_dir, resuming, exp, weights, overrides, spec_file, compile_fn, stream, tensorboard,
                       allocator, mesh_choice)


def _run_in(run_dir: Path, resuming: bool, exp, weights, overrides, spec_file, compile_fn, stream, tensorboard,
            allocator: dict, mesh_choice: dict | None) -> RunResult:
    """`run_experiment` once it holds its run directory."""
    from tessera.run.tasks import TASKS

    if resuming and (run_dir / MANIFEST).exists():  # refuse before touching another spec's run directory
        saved = load_manifest(run_dir)
        check_compatible(exp, saved["spec"], exp.resolved(), run_dir / MANIFEST, saved.get("files"))
    (run_dir / SPEC_FILE).write_text(yaml.safe_dump(exp.resolved(), sort_keys=False))
    spec_file = Path(spec_file).resolve() if spec_file else None
    manifest = _start_manifest(run_dir, exp, overrides, spec_file, weights, resuming)
    manifest.update(allocator=allocator, mesh_choice=mesh_choice)
    metrics = MetricsLog(run_dir, tensorboard=tensorboard)
    cached = cache_counts()
    try:
        with recorded(manifest, cached):
            prog = (compile_fn or default_compile)(exp)
            report = getattr(prog, "parallel_report", None)  # test doubles may not distribute
            numerics = getattr(prog, "numerics_report", None)
            manifest.update(ir_hash=prog.ir_hash, **({"parallel": report()} if report else {}),
                            **({"numerics": numerics()} if numerics else {}))
            ctx = RunContext(exp=exp, prog=prog, run_dir=run_dir, manifest=manifest, metrics=metrics,
                             stream=stream or sys.stdout, weights=Path(weights) if weights else None,
                             resume=resuming, spec_dir=spec_file.parent if spec_file else None)
            code = TASKS[exp.task.kind](ctx)
    finally:
        metrics.close()
    ctx.say(f"manifest: {run_dir / MANIFEST}")
    return RunResult(run_dir, manifest.record, code)


def run_command(spec: str, overrides: Sequence[str] = (), out: str | None = None, weights: str | None = None,
                resume: bool = False) -> int:
    """The `tessera run` command: load the spec, run it, print where the manifest is; returns the exit code."""
    from tessera.run.distributed import join
    from tessera.spec import load_experiment

    who = join()  # TESSERA_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID or SLURM_*: one process of several
    if who is not None and not who.is_main and out is not None:
        out = str(Path(out) / f"process-{who.process_id}")  # process 0 writes the run's manifest
    exp = load_experiment(spec, overrides=list(overrides or ()))
    result = run_experiment(exp, out=out, weights=weights, resume=resume, overrides=list(overrides or ()),
                            spec_file=spec)
    return result.exit_code


__all__ = ["RunResult", "run_experiment", "run_command", "default_run_dir"]
