"""The manifest file: atomic rewrites, lazy flushes that bound their cost, reading back."""

from __future__ import annotations

import json

from tessera.run.manifest import Manifest, load_manifest


def test_atomic_and_lazy_flushes(tmp_path):
    m = Manifest(tmp_path, {"metrics": [], "status": "running"})
    m.flush()
    assert load_manifest(tmp_path) == {"metrics": [], "status": "running"}
    m._write_cost = 3600.0  # as if the last write had taken an hour: a lazy flush waits
    m.update(metrics=[{"step": 1, "loss": 2.0}], lazy=True)
    assert load_manifest(tmp_path / "manifest.json")["metrics"] == []
    m.update(status="completed")  # a plain update always writes
    assert json.loads((tmp_path / "manifest.json").read_text()) == {"metrics": [{"step": 1, "loss": 2.0}],
                                                                    "status": "completed"}
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temporary file left behind
