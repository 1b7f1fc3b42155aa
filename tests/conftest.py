"""Suite-wide settings, made before any test imports jax and inherited by the subprocesses tests start:
XLA's quick CPU compile (tests/cpu_env.py) and jax's persistent compilation cache under .cache/jax, so a
program compiled by one test process (the one-device references of the sharded tests, the tiny specs) is
read back by the others, and a second `make test` compiles little. Every program is kept, however small: the
suite compiles ~13,000, most of them single jnp operations run eagerly (~15 ms of XLA each, ~2 ms read back),
and ~1,300 recur in another process: XLA's compile time summed over a cold run 1,088 -> 1,033 s."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cpu_env import xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = xla_flags()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# XLA:CPU does not autotune; left on, the first `tessera run` in a test process would add its flag to XLA_FLAGS, and
# the subprocesses started after it would key their compiled programs otherwise than those started before
os.environ.setdefault("TESSERA_AUTOTUNE_CACHE", "off")


# The files that take longest (CPU seconds with a cold compilation cache, 2-core machine), longest first: `make
# test`'s two workers start them first, and the many short files fill in behind them so both end together.
LONGEST = ("lower/shard/test_train_meshes.py", "lower/shard/test_pipeline_1f1b.py",
           "lower/shard/test_expert_dispatch.py", "lower/shard/test_context_parallel.py", "test_setup.py",
           "run/test_host_invariance.py", "lower/kernels/test_flash_attention.py", "lower/test_mxfp4_padding.py")


def pytest_configure(config):
    """Keep the order below: pytest-xdist would otherwise hand out files by their number of tests, most first, which
    put the one-test fresh-clone setup file and the few-test 8-device files last, running alone at the end."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _rank(path: Path, slow: set) -> int:
    rel = path.relative_to(ROOT / "tests").as_posix()
    return LONGEST.index(rel) if rel in LONGEST else len(LONGEST) + (path not in slow)


def pytest_collection_modifyitems(config, items):
    """The LONGEST files run first, then the other files with a `slow` test. `make test`'s two workers each take
    whole files in collection order (--dist loadfile), so a long file collected last would run alone after
    everything else has finished."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: _rank(item.path, slow))  # stable: each file's tests stay together, in order
