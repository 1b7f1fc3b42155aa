"""Training data: built-in synthetic tasks and memory-mapped token files.

Every source is a pure function of (seed, step): `batch(step)` returns the same numbers whenever it
is asked, so a resumed run sees exactly the data an uninterrupted one would. A batch is
`{"tokens": int32[B, S], "targets": int32[B, S], "mask": float32[B, S]}` with targets = tokens shifted
left by one, and `mask` marking which targets count in the loss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from tessera.diagnostics import RunError
from tessera.spec.files import file_fingerprint

PAD, SEP = 0, 1  # synthetic tasks: token 0 begins a sequence, token 1 separates question and answer
SYMBOLS_MAX = 16  # synthetic alphabet size (capped so a tiny model learns it in a couple of minutes)
STREAM_TRAIN, STREAM_EVAL = 0, 1  # independent random streams for training and eval batches


class Source(Protocol):
    """A batch source: `batch(step)` is a pure function of (seed, step, stream)."""

    fingerprint: str

    def batch(self, step: int, stream: int = STREAM_TRAIN) -> dict[str, np.ndarray]: ...


def _rng(seed: int, step: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(stream), int(step)])


# ---------------------------------------------------------------- synthetic tasks
# Each task maps a question x: int[B, L] of symbols in [0, n) to its answer, int[B, L].
def _copy(x: np.ndarray, n: int) -> np.ndarray:
    return x


def _reverse(x: np.ndarray, n: int) -> np.ndarray:
    return x[:, ::-1]


def _add(x: np.ndarray, n: int) -> np.ndarray:
    return np.cumsum(x, axis=1) % n  # running sum mod n: each answer digit depends on all earlier ones


def _sort(x: np.ndarray, n: int) -> np.ndarray:
    return np.sort(x, axis=1)


SYNTHETIC_TASKS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "copy": _copy, "reverse": _reverse, "add": _add, "sort": _sort,
}


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
    """Sequences `PAD q_1..q_L SEP a_1..a_L [PAD...]`; the loss counts only the answer tokens."""

    task: str
    seed: int
    batch_size: int
    seq_len: int
    vocab: int

    def __post_init__(self):
        if self.task not in SYNTHETIC_TASKS:
            raise RunError(f"unknown synthetic task {self.task!r}; choose one of {sorted(SYNTHETIC_TASKS)}")
        if self.vocab < 4 or self.seq_len < 4:
            raise RunError(f"synthetic task needs vocab >= 4 and seq_len >= 4 (got {self.vocab}, {self.seq_len})")

    @property
    def symbols(self) -> int:
        return min(SYMBOLS_MAX, self.vocab - 2)

    @property
    def length(self) -> int:
        return (self.seq_len - 1) // 2  # question and answer length L: PAD q SEP a fills 2L+2 <= S+1 tokens

    @property
    def fingerprint(self) -> str:
        return _sha({"kind": "synthetic", "task": self.task, "seed": self.seed, "batch": self.batch_size,
                     "seq_len": self.seq_len, "vocab": self.vocab, "symbols": self.symbols})

    def chance_loss(self) -> float:
        """Cross-entropy of guessing answer symbols uniformly: what 'learned nothing' looks like."""
        return float(np.log(self.symbols))

    def batch(self, step: int, stream: int = STREAM_TRAIN) -> dict[str, np.ndarray]:
        """Batch `step` of `stream`: tokens, targets int32[B, S], mask float32[B, S] (answer targets only)."""
        b, s, L, n = self.batch_size, self.seq_len, self.length, self.symbols
        q = _rng(self.seed, step, stream).integers(0, n, size=(b, L))
        a = SYNTHETIC_TASKS[self.task](q, n)
        seq = np.full((b, s + 1), PAD, np.int64)  # [B, S+1]: the inputs and the targets shifted by one
        seq[:, 1:L + 1] = q + 2
        seq[:, L + 1] = SEP
        seq[:, L + 2:2 * L + 2] = a + 2
        mask = np.zeros((b, s), np.float32)
        mask[:, L + 1:2 * L + 1] = 1.0  # target positions whose target is an answer symbol
        return {"tokens": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32), "mask": mask}

    def example(self, index: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """One eval question as a prompt (through SEP) and its expected answer tokens."""
        b, L = self.batch(0, STREAM_EVAL), self.length
        full = np.concatenate([b["tokens"][index], b["targets"][index, -1:]])  # [S+1]
        return full[:L + 2], full[L + 2:2 * L + 2]


# ---------------------------------------------------------------- token files
BIN_MAGIC = b"TSRTOKS\0"  # .bin header: magic (8 bytes), uint32 bytes per token (2 or 4), uint32 reserved
BIN_HEADER = 16


def write_bin(path: str | Path, tokens: np.ndarray) -> None:
    """Write a token file with the Tessera header (uint16 if every id fits, else uint32)."""
    tokens = np.asarray(tokens).ravel()
    dtype = np.uint16 if tokens.size == 0 or int(tokens.max()) < 2**16 else np.uint32
    with open(path, "wb") as fh:
        fh.write(BIN_MAGIC + np.array([np.dtype(dtype).itemsize, 0], "<u4").tobytes())
        fh.write(tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes())


def open_tokens(path: str | Path) -> np.ndarray:
    """Memory-map a token file: `.npy` (1-D integer array), or `.bin` (Tessera header, or raw uint16)."""
    path = Path(path)
    if not path.is_file():
        raise RunError(f"data file {path} does not exist")
    try:
        if path.suffix == ".npy":
            arr = np.load(path, mmap_mode="r")
        elif path.suffix == ".bin":
            arr = _open_bin(path)
        else:
            raise RunError(f"data file {path}: unknown format {path.suffix!r}; use .bin or .npy")
    except (ValueError, OSError) as exc:
        raise RunError(f"data file {path} is not a valid token file: {exc}") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise RunError(f"data file {path} must hold a 1-D integer array, found {arr.dtype}{list(arr.shape)}")
    return arr


def _open_bin(path: Path) -> np.ndarray:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(BIN_HEADER)
    if head[:8] != BIN_MAGIC:  # a raw file of uint16 ids, as many tokenizer scripts write
        if size % 2:
            raise RunError(f"data file {path}: raw .bin of uint16 tokens must have an even size, got {size} bytes")
        return np.memmap(path, dtype="<u2", mode="r")
    width = int(np.frombuffer(head[8:12], "<u4")[0]) if len(head) == BIN_HEADER else 0
    if width not in (2, 4):
        raise RunError(f"data file {path}: header says {width} bytes per token; expected 2 or 4")
    if (size - BIN_HEADER) % width:
        last = BIN_HEADER + (size - BIN_HEADER) // width * width
        raise RunError(f"data file {path} is truncated: its last token starts at byte {last:,} and needs {width} "
                       f"bytes, but the file ends at byte {size:,}")
    return np.memmap(path, dtype=f"<u{width}", mode="r", offset=BIN_HEADER)


class TokenFileSource:
    """Windows of seq_len+1 tokens from a file, in an order shuffled per epoch by the data seed."""

    def __init__(self, path: str | Path, seed: int, batch_size: int, seq_len: int, vocab: int):
        self.path, self.seed, self.batch_size, self.seq_len, self.vocab = Path(path), seed, batch_size, seq_len, vocab
        self.tokens = open_tokens(self.path)
        self.windows = (len(self.tokens) - 1) // seq_len  # window i covers tokens [i*S, i*S + S]
        if self.windows < 1:
            raise RunError(f"data file {self.path} holds {len(self.tokens)} tokens, fewer than one sequence "
                           f"of seq_len+1 = {seq_len + 1}")
        self._perm: dict[tuple[int, int], np.ndarray] = {}
        self.fingerprint = file_fingerprint(self.path)

    def _byte(self, index: int) -> int:
        """The file offset of token `index` (past any header)."""
        return int(getattr(self.tokens, "offset", 0)) + index * self.tokens.dtype.itemsize

    def _order(self, epoch: int, stream: int) -> np.ndarray:
        key = (epoch, stream)
        if key not in self._perm:
            self._perm = {key: _rng(self.seed, epoch, stream).permutation(self.windows)}  # keep one epoch
        return self._perm[key]

    def batch(self, step: int, stream: int = STREAM_TRAIN) -> dict[str, np.ndarray]:
        """Batch `step`: the (step*B)-th to (step*B+B-1)-th windows of the seeded order, every target counted."""
        s, b = self.seq_len, self.batch_size
        rows, starts = [], []
        for k in range(step * b, step * b + b):  # k-th window drawn overall
            epoch, i = divmod(k, self.windows)
            starts.append(int(self._order(epoch, stream)[i]) * s)
            rows.append(np.asarray(self.tokens[starts[-1]:starts[-1] + s + 1], np.int64))
        seq = np.stack(rows)  # [B, S+1]
        if int(seq.max()) >= self.vocab:
            r, c = np.argwhere(seq >= self.vocab)[0]
            index = starts[r] + int(c)
            raise RunError(f"data file {self.path}: token id {int(seq[r, c])} at token {index:,} (byte "
                           f"{self._byte(index):,}), read for batch {step}, is outside the model's vocabulary "
                           f"of {self.vocab}")
        return {"tokens": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32),
                "mask": np.ones((b, s), np.float32)}


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def build_source(task, vocab: int, base_dir: Path | None = None) -> Source:
    """The batch source a train task names (`task.data.kind`: synthetic | tokens | collocation | burgers | sudoku)."""
    data = task.data
    if data.kind == "synthetic":
        return SyntheticSource(data.task, int(data.seed), int(task.batch), int(task.seq_len), int(vocab))
    if data.kind == "tokens":
        path = Path(data.path)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        return TokenFileSource(path, int(data.seed), int(task.batch), int(task.seq_len), int(vocab))
    if data.kind == "collocation":
        from tessera.run.collocation import CollocationSource

        return CollocationSource(data)
    if data.kind == "burgers":
        from tessera.run.pde import BurgersSource

        return BurgersSource(data, int(task.batch))
    if data.kind == "sudoku":
        from tessera.run.sudoku import SudokuSource

        return SudokuSource(data, int(task.batch))
    raise RunError(f"unknown data kind {data.kind!r}")
