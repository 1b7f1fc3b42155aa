"""Generated data sets kept on disk, named by the hash of everything that makes them.

    arrays = cached("pde", "burgers", {"n": 1200, "seed": 0, ...}, make)   # make() -> {name: np.ndarray}

The directory is `$TESSERA_CACHE` (or ~/.cache/tessera) / `sub`; a set is written to a temporary file and
renamed into place, so a reader sees the whole set or none, and two runs making the same set at once both
end with it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np


def cache_root() -> Path:
    """Where generated sets live: $TESSERA_CACHE, else ~/.cache/tessera."""
    return Path(os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera")


def cached(sub: str, name: str, what: dict, make: Callable[[], dict[str, np.ndarray]], *,
           cache: Path | None = None) -> dict[str, np.ndarray]:
    """The arrays `make()` returns for the set described by `what` (JSON), read back when made before;
    `cache` replaces the directory (`cache_root() / sub`)."""
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]
    path = (cache or cache_root() / sub) / f"{name}-{digest}.npz"
    if path.exists():
        with np.load(path) as data:
            return {k: data[k] for k in data.files if k != "what"}
    arrays = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    np.savez(tmp, **arrays, what=json.dumps(what))
    os.replace(tmp, path)  # atomic: a reader sees the whole set or none
    return arrays
