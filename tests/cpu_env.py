"""How the CPU test suite runs XLA, in its own process and in the subprocesses its tests start.

Most of the suite's time is XLA:CPU compiling test-sized programs, whose run time is negligible. The quick
compile flags below skip LLVM's optimisation: an 8-device GPT-OSS train step compiles in ~18 s of CPU instead
of ~29 (2 cores, jax 0.10.2). Not among them: `--xla_cpu_use_fusion_emitters=false` (12 s), under which
deterministic training on tp=4 x dp=2 is no longer bit-identical to one device (the older emitters'
arithmetic depends on how a program is partitioned; with the default emitters it does not).
"""

from __future__ import annotations

import os
import shutil

QUICK_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def has_gpu() -> bool:
    """An NVIDIA driver on this machine: the GPU tests compile as users' programs do, without QUICK_COMPILE."""
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidiactl")


def xla_flags(devices: int | None = None, base: str | None = None) -> str:
    """XLA_FLAGS with the quick compile flags (kept where `base` sets them otherwise; none on a GPU machine) and
    `devices` host devices."""
    flags = (os.environ.get("XLA_FLAGS", "") if base is None else base).split()
    if devices is not None:
        flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    if has_gpu():
        return " ".join(flags)
    have = {f.split("=")[0] for f in flags}
    return " ".join(flags + [f for f in QUICK_COMPILE if f.split("=")[0] not in have])


def cpu_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """os.environ for a subprocess on the CPU with `devices` host devices (and `extra` variables)."""
    return {**os.environ, "XLA_FLAGS": xla_flags(devices), "JAX_PLATFORMS": "cpu", **extra}
