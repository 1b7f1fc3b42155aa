"""The process settings a run needs before JAX starts: the GPU allocator's share of each card, deterministic mode's
XLA flags and CPU thread count, the GEMM backend of fp8 products, and where XLA:GPU keeps its autotuning results. No
JAX import here.

XLA reads XLA_FLAGS and the allocator's variables once, when JAX starts its backend (or, where a jaxlib parses its
flags as it loads, when JAX is imported): the command line (`tessera.cli`) calls `configure_process` on the loaded spec
before anything imports JAX, and `tessera.run.main.prepare` calls it again for a Python caller (then it takes effect
only if JAX has not started yet). Calling it twice is harmless: what tessera set is recognised and reported as
before, and the person's own settings are never overridden.
"""

from __future__ import annotations

import os
from pathlib import Path

from tessera.spec.tasks import trains

# ---- the GPU allocator ---------------------------------------------------------------------------------------------

ALLOCATOR_FRACTION = "0.95"  # of each GPU's memory for JAX's pool: a plan that fits 95 % of the card runs
_ALLOCATOR_VARS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR")
_set = {}  # what this process's tessera wrote: variable -> value (so a second call recognises it)


def _ours(var: str) -> bool:
    return var in _set and os.environ.get(var) == _set[var]


def configure_allocator() -> dict:
    """Let JAX's GPU allocator take 95 % of each card (its default, 75 %, cannot hold a plan that fits the card:
    the 120b's weights alone are 81 % of an 80 GB H100), unless the person set any of its variables.

    Acts when called before JAX starts its backend; the record says who set what, and
    `tessera.run.main.describe_allocator` adds what the backend then took."""
    env = os.environ
    if any(v in env and not _ours(v) for v in _ALLOCATOR_VARS):
        return {"set_by": "user", **{v: env[v] for v in _ALLOCATOR_VARS if v in env}}
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = _set["XLA_PYTHON_CLIENT_MEM_FRACTION"] = ALLOCATOR_FRACTION
    return {"set_by": "tessera", "XLA_PYTHON_CLIENT_MEM_FRACTION": ALLOCATOR_FRACTION}


# ---- deterministic mode ------------------------------------------------------------------------------------------

# Deterministic mode's XLA flags. XLA:CPU's tree-reduction rewrite (a reduce split into a reduce-window and a
# reduce) took some reductions of a multi-device program and not the same reductions of the one-device program (the
# spectral MoE's bias gradients: dp=2 differed from one device from step 1; bench/experiments/mesh_divergence.py).
DETERMINISTIC_XLA_FLAGS = ("--xla_gpu_deterministic_ops=true", "--xla_disable_hlo_passes=tree_reduction_rewriter")

# A deterministic train step runs its canonical shards one after another, each layer's split weights read in
# place; XLA:GPU's DotMerger joins gate's and up's GEMMs by concatenating their weights on every call (8 ms a step
# at C = 1, x C shards). Off, the Llama-1B deterministic step took 357.5 ms against 382.0 on one H100 (fast mode
# 274.9 against 274.3: unchanged there; gpt-oss-20b b1 decode 419 tok/s against 434, so only a step that trains).
DETERMINISTIC_TRAIN_XLA_FLAGS = ("--xla_gpu_dot_merger_threshold_mb=0",)

# XLA:CPU's intra-op pool has max(PJRT_NPROC, the host's devices) threads (PJRT_NPROC defaults to the cores),
# and its matmuls (Eigen) split a long contraction by that count: a 1-device and an 8-device host summed the
# same dot in different orders, so the same unsharded run ended with other parameters. Every host reaches
# XLA's own cap of 256 threads, the same count everywhere; idle threads cost no CPU (timed: no slower).
DETERMINISTIC_CPU_THREADS = "256"


def request_deterministic_kernels(exp) -> None:
    """In deterministic mode (parallel.deterministic, the default) ask XLA for deterministic GPU kernels and
    for CPU matmuls whose summation order does not depend on the host (`DETERMINISTIC_CPU_THREADS`); a task that
    trains also turns XLA:GPU's dot merging off (`DETERMINISTIC_TRAIN_XLA_FLAGS`). A flag the person's XLA_FLAGS
    names is theirs.

    Scatter-adds (e.g. the embedding's gradient) otherwise use atomics whose order varies run to run.
    XLA reads both when JAX starts its backend, so this works when called before then, as `tessera run` does; a
    Python caller who already ran JAX sets XLA_FLAGS and PJRT_NPROC itself. A PJRT_NPROC the person set is kept
    (the manifest records it).
    """
    if not getattr(getattr(exp, "parallel", None), "deterministic", True):
        return
    wanted = DETERMINISTIC_XLA_FLAGS
    if getattr(exp, "task", None) is not None and trains(exp.task):
        wanted = (*wanted, *DETERMINISTIC_TRAIN_XLA_FLAGS)
    _add_flags(wanted)
    os.environ.setdefault("PJRT_NPROC", DETERMINISTIC_CPU_THREADS)


# ---- fp8 products --------------------------------------------------------------------------------------------------

# XLA:GPU hands some fp8 products to its Triton GEMM and times Triton tilings for each of them. On one H100 (jax
# 0.11.2, the Llama-3-8B layer shape, bench.e2e "llama-8b-layers train fp8") the fp8 train step compiled in 239 s and
# ran 219.1 ms a step; with Triton's GEMM off every fp8 product runs on cuBLASLt's fp8 kernels and the same step
# compiled in 16 s and ran 211.7 ms (the Llama-1B shape: 247.2 against 250.2 ms). A bf16 step loses by it (265.3
# against 246.7 ms at the 8B shape), so only a program whose products run in fp8 turns it off.
FP8_XLA_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)


def computes_in_fp8(exp) -> bool:
    """Whether `exp`'s products with weights run in fp8: its numerics.default is an fp8 type (the numerics pass then
    gives the graph its fp8 scaling). Reads a loaded spec or a manifest's recorded one (`recorded_settings`)."""
    default = getattr(getattr(exp, "numerics", None), "default", None)
    base = getattr(default, "base", default)
    return isinstance(base, str) and base.split(" ", 1)[0].startswith("fp8")


def request_fp8_gemms(exp) -> dict | None:
    """For a program whose products run in fp8, turn XLA:GPU's Triton GEMM off (`FP8_XLA_FLAGS`) unless the person's
    XLA_FLAGS names the flag. Returns {set_by, flags} (the flags in force), or None for a program without fp8."""
    if not computes_in_fp8(exp):
        return None
    names = {f.split("=")[0] for f in FP8_XLA_FLAGS}
    _fp8_set.update(_add_flags(FP8_XLA_FLAGS))
    given = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] in names]
    return {"set_by": "tessera" if all(f in _fp8_set for f in given) else "user", "flags": given}


_fp8_set: set = set()  # the fp8 flags this process's tessera added (a second call recognises them)


def recorded_settings(spec: dict):
    """What `request_deterministic_kernels` and `request_fp8_gemms` read (parallel.deterministic, the task's kind and
    what it times, numerics.default) from a manifest's recorded spec, so `tessera replay` settles the process as the
    run it replays did, before JAX starts and without loading the spec's files."""
    from types import SimpleNamespace

    parallel, task = spec.get("parallel") or {}, spec.get("task") or {}
    numerics = spec.get("numerics") or {}
    return SimpleNamespace(parallel=SimpleNamespace(deterministic=bool(parallel.get("deterministic", True))),
                           task=SimpleNamespace(kind=task.get("kind"), what=tuple(task.get("what") or ())),
                           numerics=SimpleNamespace(default=numerics.get("default")))


# ---- where compiled programs and kernel choices are kept ---------------------------------------------------------

OFF = ("off", "0", "false", "no")
AUTOTUNE_VAR = "TESSERA_AUTOTUNE_CACHE"  # a directory, or off / 0 / false / no
AUTOTUNE_FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"


def cache_root() -> Path:
    """$XDG_CACHE_HOME/tessera, by default ~/.cache/tessera."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tessera"


def default_autotune_dir() -> Path:
    """$XDG_CACHE_HOME/tessera/autotune, by default ~/.cache/tessera/autotune."""
    return cache_root() / "autotune"


def configure_autotune_cache() -> dict:
    """Keep XLA:GPU's autotuning results (the GEMM algorithm or Triton tiling it timed fastest for each fusion) on
    disk, so every later compile of the same fusion on this machine takes the same kernel.

    Where XLA autotunes (fast mode, or XLA_FLAGS turning deterministic mode's flag off), it times the candidates anew
    in each process, and the winner moves with the timing noise: on one H100, three processes of one run that lacked
    `--xla_gpu_deterministic_ops` (gpt_oss_tiny, llama_tiny in bf16, the Llama-1B shape at 4 layers; 20 steps, each
    compiled afresh) parted in the last bits at steps 3-5; with this cache the three were bit-identical at the same
    speed (bench/SCALING.md). Deterministic mode's flag makes XLA take each fusion's first candidate without timing
    any, so it is reproducible without the cache and leaves the directory empty (`autotune_record`'s `autotuning`).
    It never overrides the person: an XLA_FLAGS that names the flag is theirs, TESSERA_AUTOTUNE_CACHE=off leaves it
    unset and a directory there moves it. A directory holding whitespace cannot be passed in XLA_FLAGS and is not used
    (said in the record). Returns the record for the manifest (`autotune_cache`; `autotune_record` adds the entries
    the directory holds and whether XLA times kernels at all)."""
    global _autotune
    if not (_autotune.get("set_by") == "tessera" and _autotune.get("flags") == os.environ.get("XLA_FLAGS")):
        _autotune = _autotune_setting()
    return {k: v for k, v in _autotune.items() if k != "flags"}


def _autotune_setting() -> dict:
    env = os.environ
    flags = env.get("XLA_FLAGS", "")
    if AUTOTUNE_FLAG in flags:
        given = [f.split("=", 1)[1] for f in flags.split() if f.startswith(AUTOTUNE_FLAG + "=")]
        return {"set_by": "user", "dir": given[-1] if given else None}
    choice = env.get(AUTOTUNE_VAR, "").strip()
    if choice.lower() in OFF:
        return {"set_by": "user", "dir": None}
    path = Path(choice).expanduser() if choice else default_autotune_dir()
    who = "user" if choice else "tessera"
    if any(c.isspace() for c in str(path)):
        return {"set_by": who, "dir": None, "why_not": f"{path} holds whitespace, which XLA_FLAGS cannot carry"}
    env["XLA_FLAGS"] = " ".join([flags, f"{AUTOTUNE_FLAG}={path}"]).strip()
    # a second call finds its own flag in XLA_FLAGS: "tessera" is kept by comparing the whole string
    return {"set_by": who, "dir": str(path), **({"flags": env["XLA_FLAGS"]} if who == "tessera" else {})}


_autotune: dict = {"set_by": "user", "dir": None}  # configure_autotune_cache's record, until it is called


# XLA's autotuner times no candidates under these flags (it takes each fusion's first: autotuner_pass.cc,
# `select_first_config`), so its choice is a function of the program and nothing is kept.
FIRST_CANDIDATE = {"--xla_gpu_deterministic_ops": "true", "--xla_gpu_exclude_nondeterministic_ops": "true",
                   "--xla_gpu_autotune_level": "0"}


def _add_flags(wanted) -> list[str]:
    """Append to XLA_FLAGS each of `wanted` (`--name=value`) whose name the person's XLA_FLAGS does not give (theirs
    wins); returns the ones added."""
    flags = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in wanted if _flag(flags, f.split("=")[0]) is None]
    if missing:
        os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
    return missing


def _flag(flags: str, name: str) -> str | None:
    """The value of XLA_FLAGS' last `name=value` (XLA's own rule: the last one wins); None when absent."""
    given = [f.split("=", 1)[1] if "=" in f else "true" for f in flags.split() if f.split("=", 1)[0] == name]
    return given[-1].lower() if given else None


def autotuning(flags: str | None = None) -> str:
    """How XLA:GPU picks each fusion's kernel under `flags` (default: XLA_FLAGS now): "timed" (each process times the
    candidates, the cache keeps the winners), or "first candidate (FLAG)": no timing, nothing to keep."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    for name, value in FIRST_CANDIDATE.items():
        if _flag(flags, name) in (value, "1" if value == "true" else value):
            return f"first candidate ({name}={value})"
    return "timed"


def autotune_record() -> dict:
    """The manifest's `autotune_cache`: where XLA's GPU autotuning results are kept (`dir`, null when not), who chose
    (`set_by`), how XLA picks kernels (`autotuning`: "timed", or "first candidate (FLAG)" in deterministic mode, which
    times none), and how many result files the directory holds now (`entries`; 0 after a GPU run whose autotuning was
    "timed" means XLA did not take the setting: it read XLA_FLAGS before tessera set them)."""
    record = {k: v for k, v in _autotune.items() if k != "flags"}
    record["autotuning"] = autotuning()
    if record.get("dir"):
        where = Path(record["dir"])
        record["entries"] = sum(1 for p in where.rglob("*") if p.is_file()) if where.is_dir() else 0
    return record


def configure_process(exp) -> dict:
    """Every setting above for the spec `exp`, before JAX starts: {allocator, autotune_cache, fp8_gemms} records."""
    allocator = configure_allocator()
    request_deterministic_kernels(exp)
    fp8 = request_fp8_gemms(exp)
    return {"allocator": allocator, "autotune_cache": configure_autotune_cache(), "fp8_gemms": fp8}
