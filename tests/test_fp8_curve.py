"""bench/fp8_curve.py on the CPU: the corpus it writes is the standard library's bytes, its spec validates with
that corpus, and its comparison reports each window's mean loss, the relative gaps and the largest late gap."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench import fp8_curve
from tessera.run.data import open_tokens
from tessera.spec import load_experiment


def test_the_corpus_is_byte_tokens_and_the_spec_validates_with_it(tmp_path):
    path = fp8_curve.build_corpus(tmp_path / "bytes.bin", min_tokens=1000, root=Path(json.__file__).parent)
    tokens = np.asarray(open_tokens(path))
    assert tokens.size >= 1000 and tokens.max() < 256 and np.unique(tokens).size > 60  # text, not padding
    exp = load_experiment(fp8_curve.SPEC, overrides={"task.data.path": str(path)})
    assert exp.task.steps == 300 and exp.task.batch * exp.task.seq_len == 8 * 2048
    assert fp8_curve.build_corpus(path) == path  # written once


def test_the_comparison_averages_windows_and_reports_the_largest_late_gap(capsys):
    steps = range(1, 41)
    bf16 = {s: {"step": s, "loss": 2.0} for s in steps}
    fp8 = {s: {"step": s, "loss": 2.0 * (1.05 if s <= 10 else 1.01 if s <= 30 else 1.002)} for s in steps}
    fp8_curve.compare({"bf16": bf16, "fp8": fp8}, {"bf16": 100.0, "fp8": 125.0})
    out = capsys.readouterr().out
    assert "| 10 | 2.0000 | 2.1000 | +5.00% |" in out and "| 40 | 2.0000 | 2.0040 | +0.20% |" in out
    # the second half is steps 21-40: windows ending at 30 (+1 %) and 40 (+0.2 %); the early +5 % is not in it
    assert "over steps 21-40: 1.00%" in out
    assert "fp8: 125 tok/s over its last logged steps (1.250x bf16)" in out


def test_every_policy_passes_check_on_the_curve_spec(tmp_path):
    """Each policy as the script runs it (its numerics.default and SETTINGS) is one `tessera check` accepts: the
    fp8-unembedding policy's compute rule names the tied unembedding and takes effect there."""
    from tessera.ir.check import check_experiment
    from tessera.ir.passes.numerics import fp8_ops_of

    path = fp8_curve.build_corpus(tmp_path / "bytes.bin", min_tokens=1000, root=Path(json.__file__).parent)
    for name, default in fp8_curve.POLICIES.items():
        exp = load_experiment(fp8_curve.SPEC, [f"numerics.default={default}", f"task.data.path={path}",
                                               *fp8_curve.SETTINGS.get(name, ())])
        graph = check_experiment(exp)
        assert fp8_ops_of(graph.attrs) == ({"embed/unembed": True} if name.endswith("-unembedding") else None)
