"""Reading the tensors of a Hugging Face checkpoint directory: safetensors shards, index file, MXFP4 pairs.

`TensorSource` lists every tensor without loading it (shapes come from the headers) and loads one
on demand. An MXFP4 pair `<name>_blocks` + `<name>_scales` appears as the one dense tensor `<name>`
[E, in, out], decoded when read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from tessera.diagnostics import Diagnostic, TesseraError, relpath
from tessera.lower.hf.mxfp4 import GROUP, decode_mxfp4

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(directory: Path) -> list[Path]:
    """The shard files: those the index names, else model.safetensors; an error when neither exists."""
    index = directory / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [f for f in files if not f.is_file()]
        if absent:
            raise TesseraError([Diagnostic(f"{INDEX} names shard {f.name}, which is not in {relpath(directory)}")
                                for f in absent])
        return files
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    raise TesseraError(Diagnostic(f"no {SINGLE} or {INDEX} in {relpath(directory)}"))


def damage(path: Path) -> str | None:
    """Where a safetensors file breaks its format, with byte offsets (None if no fault is found here).

    The format: 8 bytes of little-endian header length N, N bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}} (offsets relative to byte 8 + N), then the data, which must end the file.
    """
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"the file is {size} bytes, shorter than the 8-byte header length it must start with"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return f"the header length says {n:,} bytes of JSON from byte 8, but the file ends at byte {size:,}"
        text = fh.read(n)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        at = 8 + getattr(exc, "pos", getattr(exc, "start", 0))
        return f"the JSON header is invalid at byte {at:,} ({exc})"
    ends = [(info["data_offsets"][1], name) for name, info in header.items()
            if name != "__metadata__" and isinstance(info, dict) and "data_offsets" in info]
    end, name = max(ends, default=(0, None))
    if 8 + n + end > size:
        return (f"tensor `{name}` ends at byte {8 + n + end:,}, but the file ends at byte {size:,} "
                f"(truncated: {8 + n + end - size:,} bytes missing)")
    if 8 + n + end < size:
        return f"the data ends at byte {8 + n + end:,}, but the file goes on to byte {size:,}"
    return None


class TensorSource:
    """Every tensor of a checkpoint by name: where it lives, its shape, and its value on demand."""

    def __init__(self, directory: Path):
        self.files: dict[str, Path] = {}
        self._handles = {}
        for path in checkpoint_files(directory):
            try:
                handle = self._handles[path] = safe_open(str(path), framework="numpy")
            except Exception as exc:  # safetensors' SafetensorError; an OSError for an unreadable file
                raise TesseraError(Diagnostic(f"{relpath(path)} cannot be read as safetensors: "
                                              f"{damage(path) or exc}")) from None
            for name in handle.keys():
                self.files[name] = path
        self.mxfp4 = {n[: -len("_blocks")] for n in self.files
                      if n.endswith("_blocks") and n[: -len("_blocks")] + "_scales" in self.files}

    def names(self) -> set[str]:
        """All tensor names, an MXFP4 pair counted as its dense name."""
        paired = {m + suffix for m in self.mxfp4 for suffix in ("_blocks", "_scales")}
        return (set(self.files) - paired) | self.mxfp4

    def __contains__(self, name: str) -> bool:
        return name in self.mxfp4 or name in self.files

    def where(self, name: str) -> Path:
        """The shard that holds `name` (the blocks' shard for MXFP4)."""
        return self.files[name + "_blocks" if name in self.mxfp4 else name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape from the header; MXFP4 as decoded: [..., in, out]."""
        if name in self.mxfp4:
            *lead, out, groups, _ = self._slice(name + "_blocks").get_shape()
            return (*lead, groups * GROUP, out)
        return tuple(self._slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """The tensor's value; MXFP4 decoded to fp32."""
        if name in self.mxfp4:
            return decode_mxfp4(self._get(name + "_blocks"), self._get(name + "_scales"))
        return self._get(name)

    def get_packed(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """An MXFP4 pair's raw bytes as stored: (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32])."""
        return self._get(name + "_blocks"), self._get(name + "_scales")

    def _slice(self, name: str):
        return self._handles[self.files[name]].get_slice(name)

    def _get(self, name: str) -> np.ndarray:
        return self._handles[self.files[name]].get_tensor(name)
