"""Writes the golden sharding snapshots: python -m tests.lower.shard.make_snapshots (then review the diff)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OUT = ROOT / "tests" / "data" / "sharding"
SPECS = ("gpt_oss_tiny", "llama_tiny", "gpt_oss_20b", "gpt_oss_120b")
MESHES = {
    "dp8": {"mesh.dp": 8},
    "fsdp8": {"mesh.fsdp": 8},
    "tp4_dp2": {"mesh.tp": 4, "mesh.dp": 2},
    "fsdp2_tp2_ep2": {"mesh.fsdp": 2, "mesh.tp": 2, "mesh.ep": 2},
    "pp2_tp2_dp2": {"mesh.pp": 2, "mesh.tp": 2, "mesh.dp": 2},
}
SKIP = {("llama_tiny", "tp4_dp2"), ("gpt_oss_tiny", "tp4_dp2")}  # the tiny specs: kv_heads=2 does not split 4 ways


def snapshot(spec: str, mesh: dict) -> dict:
    """The sharding snapshot of a shipped spec on a mesh."""
    from tessera.lower.options import CompileOptions
    from tessera.lower.program import program_graph
    from tessera.lower.shard.snapshot import sharding_snapshot
    from tessera.spec import load_experiment

    exp = load_experiment(ROOT / "specs" / f"{spec}.yaml", overrides=mesh)
    return sharding_snapshot(CompileOptions.of(exp), program_graph(exp))


def cases():
    """(file name, spec, mesh overrides) of every snapshot."""
    return [(f"{s}.{m}.json", s, o) for s in SPECS for m, o in MESHES.items() if (s, m) not in SKIP]


def render(snap: dict) -> str:
    """JSON with one line per parameter, so a diff names the parameter that changed."""
    lines = [f'  "{k}": {json.dumps(v)},' for k, v in snap.items() if k != "params"]
    params = [f'    "{path}": {json.dumps(p)}' for path, p in snap["params"].items()]
    return "{\n" + "\n".join(lines) + '\n  "params": {\n' + ",\n".join(params) + "\n  }\n}\n"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, spec, mesh in cases():
        (OUT / name).write_text(render(snapshot(spec, mesh)))


if __name__ == "__main__":
    main()
