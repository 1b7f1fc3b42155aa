"""`tessera run` keeps compiled programs on disk (tessera/run/compiletime.py: `configure_compilation_cache`): a second
process loads what the first compiled, with the same bits; the person's own setting or `off` wins. Each case runs in
a fresh process (jax decides once per process whether to use the cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cpu_env import cpu_env

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
jax.jit(lambda x: x + 1)(1.0)  # something compiled before the cache is set, as `tessera run` loads a spec first
from tessera.run.compiletime import cache_counts, configure_compilation_cache
record = configure_compilation_cache()
before = cache_counts()
x = jnp.linspace(0.0, 3.0, 64)
y = jax.jit(lambda x: jnp.sin(x) * jnp.exp(-x) + jnp.cumsum(x) / 7.0)(x)
hits = cache_counts()["hits"] - before["hits"]
print(json.dumps({**record, "hits": hits, "y": [float(v) for v in y]}))
"""


def _run(tmp_path, **env) -> dict:
    base = {k: v for k, v in cpu_env().items() if k not in ("JAX_COMPILATION_CACHE_DIR", "TESSERA_COMPILATION_CACHE")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env={**base, "XDG_CACHE_HOME": str(tmp_path / "xdg"),
                                                            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **env},
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    first, second = _run(tmp_path), _run(tmp_path)
    where = str(tmp_path / "xdg" / "tessera" / "jax")
    assert first["set_by"] == second["set_by"] == "tessera" and first["dir"] == second["dir"] == where
    assert first["hits"] == 0 and second["hits"] >= 1 and os.listdir(where)
    assert first["y"] == second["y"]


def test_the_persons_setting_wins(tmp_path):
    theirs = tmp_path / "theirs"
    got = _run(tmp_path, JAX_COMPILATION_CACHE_DIR=str(theirs))
    assert (got["set_by"], got["dir"]) == ("user", str(theirs)) and os.listdir(theirs)
    moved = _run(tmp_path, TESSERA_COMPILATION_CACHE=str(tmp_path / "moved"))
    assert (moved["set_by"], moved["dir"]) == ("user", str(tmp_path / "moved")) and os.listdir(tmp_path / "moved")
    off = _run(tmp_path, TESSERA_COMPILATION_CACHE="off")
    assert (off["set_by"], off["dir"], off["hits"]) == ("user", None, 0) and not (tmp_path / "xdg").exists()


# ---- XLA's GPU autotuning results (`configure_autotune_cache`): environment only, so in this process ----------------

def _autotune(monkeypatch, tmp_path, flags=None, choice=None):
    from tessera.run.environment import AUTOTUNE_VAR, autotune_record, configure_autotune_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for var, value in (("XLA_FLAGS", flags), (AUTOTUNE_VAR, choice)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    record = configure_autotune_cache()
    assert {k: v for k, v in autotune_record().items() if k not in ("entries", "autotuning")} == record
    return record, os.environ.get("XLA_FLAGS", "")


def test_autotune_results_are_kept_beside_the_compiled_programs(monkeypatch, tmp_path):
    record, flags = _autotune(monkeypatch, tmp_path, flags="--xla_gpu_deterministic_ops=true")
    where = str(tmp_path / "xdg" / "tessera" / "autotune")
    assert record == {"set_by": "tessera", "dir": where}
    assert flags == f"--xla_gpu_deterministic_ops=true --xla_gpu_per_fusion_autotune_cache_dir={where}"
    from tessera.run.environment import autotune_record, configure_autotune_cache

    assert configure_autotune_cache() == record and os.environ["XLA_FLAGS"] == flags  # again: tessera's, said so
    # deterministic mode's flag: XLA times no kernels, so nothing is kept (measured on one H100: entries 0)
    assert autotune_record()["autotuning"] == "first candidate (--xla_gpu_deterministic_ops=true)"
    assert autotune_record()["entries"] == 0


def test_the_record_says_when_xla_times_kernels():
    from tessera.run.environment import autotuning

    assert autotuning("") == "timed"
    assert autotuning("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false") == "timed"  # last wins
    assert autotuning("--xla_gpu_deterministic_ops=false --xla_gpu_deterministic_ops") == (
        "first candidate (--xla_gpu_deterministic_ops=true)")
    assert autotuning("--xla_gpu_exclude_nondeterministic_ops=1") == (
        "first candidate (--xla_gpu_exclude_nondeterministic_ops=true)")
    assert autotuning("--xla_gpu_autotune_level=0") == "first candidate (--xla_gpu_autotune_level=0)"
    assert autotuning("--xla_gpu_autotune_level=4 --xla_gpu_deterministic_ops_x=true") == "timed"


def test_the_persons_autotune_setting_wins(monkeypatch, tmp_path):
    theirs = "--xla_gpu_per_fusion_autotune_cache_dir=/their/dir --xla_dump_to=/x"
    record, flags = _autotune(monkeypatch, tmp_path, flags=theirs, choice=str(tmp_path / "ignored"))
    assert (record, flags) == ({"set_by": "user", "dir": "/their/dir"}, theirs)
    record, flags = _autotune(monkeypatch, tmp_path, choice="off")
    assert (record, flags) == ({"set_by": "user", "dir": None}, "")
    record, flags = _autotune(monkeypatch, tmp_path, choice=str(tmp_path / "moved"))
    assert record == {"set_by": "user", "dir": str(tmp_path / "moved")}
    assert flags == f"--xla_gpu_per_fusion_autotune_cache_dir={tmp_path / 'moved'}"
    record, flags = _autotune(monkeypatch, tmp_path, choice=str(tmp_path / "a dir"))
    assert record["dir"] is None and "whitespace" in record["why_not"] and flags == ""


def test_the_command_line_settles_the_process_before_jax_is_imported(tmp_path):
    script = f"""
import sys
import tessera.run.environment as environment
settle = environment.configure_process
def watched(exp):
    print("JAX_IMPORTED_BEFORE", "jax" in sys.modules, flush=True)
    return settle(exp)
environment.configure_process = watched
from tessera.cli import main
sys.exit(main(["run", "specs/llama_tiny.yaml", "--set", "task.steps=1", "--set", "task.sample=null",
               "--set", "task.eval_every=0", "--out", {str(tmp_path / 'run')!r}]))
"""
    env = {**cpu_env(), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop("TESSERA_AUTOTUNE_CACHE", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "JAX_IMPORTED_BEFORE False" in out.stdout
    record = json.loads((tmp_path / "run" / "manifest.json").read_text())["autotune_cache"]
    assert record == {"set_by": "tessera", "dir": str(tmp_path / "xdg" / "tessera" / "autotune"), "entries": 0,
                      "autotuning": "first candidate (--xla_gpu_deterministic_ops=true)"}  # llama_tiny: deterministic
