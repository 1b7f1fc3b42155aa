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


def pytest_collection_modifyitems(config, items):
    """Files with a `slow` test run first. `make test`'s two workers each take whole files in collection order
    (--dist loadfile), so a long file collected last (the 8-device training files sit in the middle, the
    fresh-clone setup test at the very end) would run alone after everything else has finished."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: each file's tests stay together, in order
