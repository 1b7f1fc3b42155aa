"""Suite-wide settings, made before any test imports jax and inherited by the subprocesses tests start:
XLA's quick CPU compile (tests/cpu_env.py) and jax's persistent compilation cache under .cache/jax, so a
program compiled by one test process (the one-device references of the sharded tests, the tiny specs) is
read back by the others, and a second `make test` compiles little."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cpu_env import xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = xla_flags()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
