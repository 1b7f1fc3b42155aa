"""Data sources: synthetic tasks are pure functions of (seed, step); token files are checked with plain messages."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest

from tessera.diagnostics import RunError
from tessera.run.data import (SEP, STREAM_EVAL, SyntheticSource, TokenFileSource, build_source, open_tokens,
                              write_bin)


def test_synthetic_batch_is_pure_function_of_seed_and_step():
    a = SyntheticSource("copy", 3, 4, 16, 20)
    b = SyntheticSource("copy", 3, 4, 16, 20)
    for step in (0, 7):
        x, y = a.batch(step), b.batch(step)
        assert all(np.array_equal(x[k], y[k]) for k in x)
    assert not np.array_equal(a.batch(0)["tokens"], a.batch(1)["tokens"])
    assert not np.array_equal(a.batch(0)["tokens"], a.batch(0, STREAM_EVAL)["tokens"])
    assert not np.array_equal(a.batch(0)["tokens"], SyntheticSource("copy", 4, 4, 16, 20).batch(0)["tokens"])
    assert a.fingerprint == b.fingerprint != SyntheticSource("copy", 4, 4, 16, 20).fingerprint


@pytest.mark.parametrize("task, answer", [
    ("copy", [3, 1, 2, 5, 0, 4, 0]), ("reverse", [0, 4, 0, 5, 2, 1, 3]),
    ("sort", [0, 0, 1, 2, 3, 4, 5]), ("add", [3, 4, 6, 11 % 16, 11 % 16, 15, 15])])
def test_synthetic_layout_and_answers(task, answer, monkeypatch):
    src = SyntheticSource(task, 0, 1, 16, 20)
    q = np.array([[3, 1, 2, 5, 0, 4, 0]])
    monkeypatch.setattr("tessera.run.data._rng", lambda *a: types.SimpleNamespace(integers=lambda *a, **k: q))
    batch = src.batch(0)
    L = src.length
    assert L == 7 and batch["tokens"].shape == (1, 16) and batch["tokens"].dtype == np.int32
    seq = np.concatenate([batch["tokens"][0], batch["targets"][0, -1:]])
    assert seq[0] == 0 and seq[L + 1] == SEP and list(seq[1:L + 1] - 2) == list(q[0])
    assert list(seq[L + 2:2 * L + 2] - 2) == answer
    assert np.array_equal(batch["targets"][0, :-1], batch["tokens"][0, 1:])
    assert list(np.flatnonzero(batch["mask"][0])) == list(range(L + 1, 2 * L + 1))  # targets = answer tokens
    assert np.array_equal(batch["targets"][0][batch["mask"][0] > 0] - 2, answer)


def test_token_files_roundtrip_and_order(tmp_path):
    ids = np.arange(1000) % 50
    write_bin(tmp_path / "a.bin", ids)
    np.save(tmp_path / "a.npy", ids.astype(np.int32))
    (tmp_path / "raw.bin").write_bytes(ids.astype("<u2").tobytes())
    for name in ("a.bin", "a.npy", "raw.bin"):
        assert np.array_equal(open_tokens(tmp_path / name), ids)
    write_bin(tmp_path / "big.bin", np.array([70000, 1]))
    assert open_tokens(tmp_path / "big.bin").dtype == np.dtype("<u4")
    write_bin(tmp_path / "seq.bin", np.arange(1000))  # a window is known by its first token
    src = TokenFileSource(tmp_path / "seq.bin", seed=5, batch_size=4, seq_len=8, vocab=1000)
    b0 = src.batch(0)
    assert np.array_equal(b0["targets"][:, :-1], b0["tokens"][:, 1:])
    assert src.windows == 124
    starts = [int(r[0]) for s in range(31) for r in src.batch(s)["tokens"]]  # one epoch: each window once
    assert sorted(starts) == [8 * i for i in range(124)] and starts != sorted(starts)
    again = TokenFileSource(tmp_path / "seq.bin", seed=5, batch_size=4, seq_len=8, vocab=1000)
    assert np.array_equal(again.batch(40)["tokens"], src.batch(40)["tokens"])  # past the first epoch
    assert not np.array_equal(TokenFileSource(tmp_path / "seq.bin", 6, 4, 8, 1000).batch(0)["tokens"], b0["tokens"])


def test_bad_data_files_have_plain_messages(tmp_path):
    def err(path, **kw) -> str:
        with pytest.raises(RunError) as e:
            TokenFileSource(path, 0, kw.get("batch", 2), kw.get("seq", 8), kw.get("vocab", 50)).batch(0)
        return str(e.value)

    assert "does not exist" in err(tmp_path / "missing.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    assert "even size" in err(tmp_path / "odd.bin")
    write_bin(tmp_path / "t.bin", np.arange(100))
    (tmp_path / "trunc.bin").write_bytes((tmp_path / "t.bin").read_bytes()[:-1])
    assert "truncated: its last token starts at byte 214 and needs 2 bytes, but the file ends at byte 215" in err(
        tmp_path / "trunc.bin")
    bad = bytearray((tmp_path / "t.bin").read_bytes())
    bad[8] = 3
    (tmp_path / "width.bin").write_bytes(bytes(bad))
    assert "3 bytes per token" in err(tmp_path / "width.bin")
    write_bin(tmp_path / "short.bin", np.arange(5))
    assert "fewer than one sequence" in err(tmp_path / "short.bin")
    msg = err(tmp_path / "t.bin", batch=20)
    found = re.search(r"token id (\d+) at token (\d+) \(byte (\d+)\), read for batch 0, is outside the model's "
                      r"vocabulary of 50", msg)
    assert found, msg
    token, index, offset = map(int, found.groups())  # the file holds 0, 1, 2, ...: a token's id is its index
    assert token == index >= 50 and offset == 16 + 2 * index
    np.save(tmp_path / "f.npy", np.zeros(100, np.float32))
    assert "1-D integer array" in err(tmp_path / "f.npy")
    (tmp_path / "x.txt").write_text("1 2 3")
    assert "unknown format '.txt'" in err(tmp_path / "x.txt")
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    assert "not a valid token file" in err(tmp_path / "junk.npy")


def test_build_source_from_task(tmp_path):
    write_bin(tmp_path / "d.bin", np.arange(200) % 30)
    task = types.SimpleNamespace(batch=2, seq_len=8, data=types.SimpleNamespace(kind="tokens", path="d.bin", seed=0))
    assert isinstance(build_source(task, 30, base_dir=tmp_path), TokenFileSource)
    task.data = types.SimpleNamespace(kind="synthetic", task="reverse", seed=0)
    assert build_source(task, 30).task == "reverse"


def test_progress_bar_on_a_terminal_and_plain_lines_otherwise():
    import io

    from tessera.run.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, plain = Tty(), io.StringIO()
    for stream in (tty, plain):
        with Progress(10, 0, stream=stream) as bar:
            bar.update(5, {"loss": 1.5, "tok/s": 1000.0})
            bar.update(10, {"loss": 0.5, "tok/s": 1000.0})
    assert "10/10" in tty.getvalue() and "loss 0.5" in tty.getvalue() and "\x1b" in tty.getvalue()
    assert plain.getvalue().splitlines()[0].startswith("train step 5/10  loss 1.5  tok/s 1000  eta ")
