"""The files a spec names (model, token data): where they are, and what they hold.

A resolved spec holds absolute paths, which differ between checkouts of the same project. What makes two
runs the same is the files' content, so `spec_hash` hashes each file's fingerprint in place of its path,
and a manifest records path, path relative to the working directory, and fingerprint of every file, so a
replay on another machine can find them again (`locate`).
"""

from __future__ import annotations

import copy
import functools
import hashlib
from pathlib import Path
from typing import Any

from tessera.diagnostics import relpath

# Paths in a spec that are files to read: made absolute against the file that wrote them, and must exist.
FILE_KEYS = (("model", "file"), ("task", "data", "path"), ("task", "tokens_file"))


def file_fingerprint(path: str | Path, whole_below: int = 64 << 20, chunk: int = 1 << 20) -> str:
    """sha256 of the file; above 64 MiB, of its size and 16 evenly spaced 1 MiB chunks ("sampled:" prefix)."""
    st = Path(path).stat()
    return _fingerprint(str(Path(path).resolve()), st.st_size, st.st_mtime_ns, whole_below, chunk)


@functools.lru_cache(maxsize=64)
def _fingerprint(path: str, size: int, mtime_ns: int, whole_below: int, chunk: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= whole_below:
            for block in iter(lambda: fh.read(chunk), b""):
                h.update(block)
            return h.hexdigest()
        h.update(str(size).encode())
        for k in range(16):
            fh.seek((size - chunk) * k // 15)
            h.update(fh.read(chunk))
    return "sampled:" + h.hexdigest()


def _get(tree: dict, key: tuple[str, ...]) -> Any:
    for part in key:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def named_files(resolved: dict) -> dict[str, str]:
    """{"model.file": path, ...}: the file paths a resolved spec names."""
    found = {".".join(key): _get(resolved, key) for key in FILE_KEYS}
    return {k: v for k, v in found.items() if isinstance(v, str) and v}


def replaced(resolved: dict, values: dict[str, object]) -> dict:
    """A copy of the resolved spec with the value at each dotted key ("model.file") replaced, where it is set."""
    out = copy.deepcopy(resolved)
    for dotted, value in values.items():
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            node[leaf] = value
    return out


def portable(resolved: dict) -> dict:
    """The resolved spec with each named file's path replaced by its fingerprint (what `spec_hash` hashes)."""
    return replaced(resolved, {key: "sha256:" + file_fingerprint(path) if Path(path).is_file() else "missing:" + path
                               for key, path in named_files(resolved).items()})


def file_records(resolved: dict) -> dict[str, dict]:
    """{key: {path, relative, sha256}} for a manifest: enough to find the same files from another checkout."""
    records = {}
    for key, path in named_files(resolved).items():
        if Path(path).is_file():
            shown = relpath(path)
            records[key] = {"path": path, "relative": None if Path(shown).is_absolute() else shown,
                            "sha256": file_fingerprint(path)}
    return records


def locate(record: dict) -> tuple[str | None, str]:
    """(a path holding the recorded content, or None; what was tried) for one `file_records` entry."""
    tried = []
    for candidate in (record.get("path"), record.get("relative")):
        if not candidate:
            continue
        p = Path(candidate)
        if not p.is_file():
            tried.append(f"{candidate} (missing)")
        elif file_fingerprint(p) != record.get("sha256"):
            tried.append(f"{candidate} (content differs)")
        else:
            return str(p.resolve()), ""
    return None, ", ".join(tried)


def by_content(resolved: dict, records: dict[str, dict] | None) -> dict:
    """The resolved spec with each file that `records` fingerprints replaced by "sha256:<fingerprint>", so
    specs compare equal when they name the same content at different paths (older records: paths stay)."""
    return replaced(resolved, {key: "sha256:" + rec["sha256"] for key, rec in (records or {}).items()
                               if rec.get("sha256")})
