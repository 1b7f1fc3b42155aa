"""fp8 against bf16 training on the same data: the loss curves of specs/bench/llama_1b_fp8_curve.yaml (the
Llama-3.2-1B shape, 300 steps of byte-level text) under each numeric policy, and their step times (issue 35).

    python -m bench.fp8_curve [--steps 300] [--policies bf16,fp8,fp8-delayed,fp8-delayed-unembedding,...]
        [--records DIR] [--set KEY=VALUE ...]

The token file is the Python standard library's `.py` sources as bytes (ids 0-255, sorted by path), written once
to .cache/tessera/stdlib_bytes.bin: text every machine has, so the curves need no download. Each policy runs as
`tessera run` in a process of its own (fresh run directory, checkpoint deleted after) and the script prints, at
every 10 steps, each policy's mean loss over those steps and its relative difference from the first policy's, then
the largest difference over the run's second half (the target: within 1 %) and the tokens/s of each. With
`--records DIR` each policy's metrics are kept in DIR/<policy>.json and a policy already there is not run again,
so the runs can be spread over several sessions on a GPU (each takes ~3 minutes on an H200).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs/bench/llama_1b_fp8_curve.yaml"
CORPUS = ROOT / ".cache/tessera/stdlib_bytes.bin"
POLICIES = {
    "bf16": "bf16 @accum(fp32)",
    "fp8": "fp8_e4m3 @scale(per_tensor) @accum(fp32)",
    "fp8-delayed": "fp8_e4m3 @scale(delayed(16)) @accum(fp32)",
    "fp8-unembedding": "fp8_e4m3 @scale(per_tensor) @accum(fp32)",
    "fp8-delayed-unembedding": "fp8_e4m3 @scale(delayed(16)) @accum(fp32)",
}
# a policy's settings beside its numerics.default: the (tied) unembedding's product in fp8 too, which the default,
# like torchtitan's and Transformer Engine's recipes, leaves in bf16 (docs/kernels-log.md: 1.065x the 8B-shape step)
SETTINGS = {name: [f'numerics.compute={{"*unembed": "{POLICIES[name]}"}}'] for name in ("fp8-unembedding",
                                                                                   "fp8-delayed-unembedding")}


def build_corpus(path: Path = CORPUS, min_tokens: int = 8 * 2048 * 300 * 2, root: Path | None = None) -> Path:
    """The `.py` sources under `root` (default: the standard library) as byte tokens, at least `min_tokens`
    (repeated if the sources are short)."""
    from tessera.run.data import write_bin

    if path.exists():
        return path
    files = sorted(Path(root or sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    tokens = np.concatenate([np.frombuffer(f.read_bytes(), np.uint8) for f in files])
    if tokens.size < min_tokens:
        tokens = np.tile(tokens, -(-min_tokens // tokens.size))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    write_bin(tmp, tokens.astype(np.uint16))
    tmp.replace(path)
    print(f"corpus: {len(files)} files, {tokens.size:,} byte tokens -> {path}", flush=True)
    return path


def run_policy(name: str, steps: int, corpus: Path, extra=()) -> tuple[list[dict], float | None]:
    """(the metrics records, the last logged tokens/s) of one `tessera run` of the spec under POLICIES[name]."""
    out = Path(tempfile.mkdtemp(prefix=f"fp8curve-{name}-"))
    cmd = [sys.executable, "-c", "import sys; from tessera.cli import main; sys.exit(main())", "run", str(SPEC),
           "--set", f"numerics.default={POLICIES[name]}", "--set", f"task.steps={steps}",
           "--set", f"task.data.path={corpus}", *[a for kv in [*SETTINGS.get(name, ()), *extra] for a in ("--set", kv)],
           "--out", str(out)]
    print(f"== {name}: {POLICIES[name]}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
    print(tail, flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: tessera run exited {proc.returncode}")
    manifest = json.loads((out / "manifest.json").read_text())  # every metrics record, and the last tokens/s
    shutil.rmtree(out, ignore_errors=True)  # the 1B model's checkpoint is ~15 GB
    return manifest["metrics"], manifest.get("tokens_per_s")


def train_records(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if "loss" in r and "step" in r}


def compare(curves: dict[str, dict[int, dict]], rates: dict[str, float | None], window: int = 10) -> None:
    """Each policy's loss averaged over windows of `window` steps (one batch's loss is noisy), the relative
    difference of each window's mean from the first policy's, and the largest over the run's second half."""
    names = list(curves)
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    ends = [s for s in steps if s % window == 0 and all(t in steps for t in range(s - window + 1, s + 1))]
    mean = {n: {e: float(np.mean([curves[n][t]["loss"] for t in range(e - window + 1, e + 1)])) for e in ends}
            for n in names}
    print(f"\nloss, mean of the {window} steps ending at each row's step")
    print("| step | " + " | ".join(names) + " | " + " | ".join(f"{n} vs {names[0]}" for n in names[1:]) + " |")
    print("|---|" + "---|" * (2 * len(names) - 1))
    for e in ends:
        losses = [mean[n][e] for n in names]
        print(f"| {e} | " + " | ".join(f"{lo:.4f}" for lo in losses) + " | "
              + " | ".join(f"{(lo - losses[0]) / losses[0]:+.2%}" for lo in losses[1:]) + " |")
    late = [e for e in ends if e > ends[-1] // 2] or ends
    for n in names[1:]:
        worst = max(abs(mean[n][e] - mean[names[0]][e]) / mean[names[0]][e] for e in late)
        print(f"{n} vs {names[0]}: largest |relative difference| of the {window}-step means over steps "
              f"{late[0] - window + 1}-{late[-1]}: {worst:.2%}")
    for n in names:
        if rates.get(n) and rates.get(names[0]):
            print(f"{n}: {rates[n]:,.0f} tok/s over its last logged steps ({rates[n] / rates[names[0]]:.3f}x {names[0]})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--policies", default="bf16,fp8,fp8-delayed")
    ap.add_argument("--records", type=Path, default=None, metavar="DIR",
                    help="keep each policy's metrics in DIR/<policy>.json; reuse those already there")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more spec overrides for every run (e.g. a smaller model for a smoke run)")
    args = ap.parse_args(argv)
    names = [p.strip() for p in args.policies.split(",")]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {list(POLICIES)}")
    corpus = build_corpus()
    runs = {}
    for n in names:
        saved = args.records / f"{n}.json" if args.records else None
        if saved is not None and saved.exists():
            data = json.loads(saved.read_text())
            runs[n] = (data["records"], data["tokens_per_s"])
            print(f"== {n}: from {saved}", flush=True)
            continue
        runs[n] = run_policy(n, args.steps, corpus, args.set)
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps({"policy": POLICIES[n], "steps": args.steps, "overrides": args.set,
                                         "records": runs[n][0], "tokens_per_s": runs[n][1]}))
    compare({n: train_records(r) for n, (r, _) in runs.items()}, {n: rate for n, (_, rate) in runs.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
