"""Tessera across the GPUs of one host: generation, training and determinism, in one command.

    python bench/scaling.py                      # every section, sized to the GPUs this host has
    python bench/scaling.py --sections determinism --steps 8
    python bench/scaling.py --sections determinism --steps 20 --repeat 2 --canonical-tp 2 --canonical-ep 2 \
        --det-set model.args.layers=8          # tp, ep and pp splitting the compute (issue 36's table)
    JAX_PLATFORMS=cpu python bench/scaling.py --sections determinism --gpus 4 --steps 2 ...
                                               # the same table on 4 host devices: a dry run of the script

Each configuration runs as its own process (`CUDA_VISIBLE_DEVICES` picks its GPUs), through the
same code path as `tessera run`, and reports what its manifest recorded plus the peak memory per GPU
the runtime measured, beside `tessera plan`'s prediction for the same spec.

Sections:
  generate     GPT-OSS generation with random weights in the spec's numerics (120b at 8 GPUs,
               20b below): prefill and decode tokens/s, peak memory per GPU against the plan.
  train        a training step of gpt_oss_20b under fsdp×ep and fsdp×tp meshes: step time, MFU from
               the graph's FLOPs, tokens/s.
  determinism  the same short training run of a small model on 1, 2, 4, 8 GPUs and different meshes:
               losses and final checksums must be bit-identical; the cost of deterministic mode
               against fast mode on each mesh (det step / fast step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = float(2 ** 30)


def worker(spec: str, overrides: list[str], out: str, report: str) -> None:
    """Run one configuration in this process and write what it measured to `report` (JSON)."""
    import tessera
    from tessera.run.environment import configure_process

    exp = tessera.load(spec, overrides=overrides)
    configure_process(exp)  # before the plan starts JAX, as `tessera run` does before importing it

    import jax

    from tessera.run.main import run_experiment
    from tessera.run.plan import build_plan

    plan = build_plan(exp)
    result = run_experiment(exp, out=out, overrides=overrides, tensorboard=False)
    manifest = json.loads((Path(result.run_dir) / "manifest.json").read_text())
    peaks = [d.memory_stats().get("peak_bytes_in_use", 0) for d in jax.local_devices() if d.memory_stats()]
    Path(report).write_text(json.dumps({
        "manifest": {k: manifest.get(k) for k in ("metrics", "params_checksum", "speed", "tokens_per_s",
                                                    "status", "error", "parallel", "tensor", "experts", "pipeline")},
        "peak_gib_per_gpu": max(peaks) / GIB if peaks else None,
        "plan_gib_per_gpu": plan["memory_per_device"]["total"] / GIB,
        "plan": {"flops": plan.get("flops"), "collectives": plan.get("collectives")},
        "devices": len(jax.devices()),
    }))


def run_tag(spec: str, overrides: list[str], attempt: int = 0) -> str:
    """A configuration's name in its run directory and report: the overrides spelled out, cut at 80 characters
    with a digest of the whole (configurations whose overrides differ past the cut must not share a directory: a
    fast run had resumed the deterministic run of the same mesh), and which repeat it is."""
    tag = "-".join(o.replace("=", "").replace(".", "_") for o in overrides)
    if len(tag) > 80:
        tag = f"{tag[:64]}-{hashlib.sha256(tag.encode()).hexdigest()[:12]}"
    tag = f"{Path(spec).stem}-{tag or 'base'}"
    return tag + (f"-again{attempt}" if attempt else "")


def run_one(spec: str, gpus: int, overrides: list[str], tmp: Path, attempt: int = 0) -> dict:
    """One configuration in a fresh process on the first `gpus` GPUs; returns its report. `attempt` tells the
    repeats of one configuration apart (each its own run directory and report)."""
    tag = run_tag(spec, overrides, attempt)
    out, report = tmp / f"{Path(spec).stem}-{gpus}-{tag}", tmp / f"{tag}-{gpus}.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(gpus)))
    if env.get("JAX_PLATFORMS") == "cpu":  # a dry run of the table on the CPU: `gpus` host devices
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={gpus}".strip()
    cmd = [sys.executable, __file__, "--worker", spec, "--out", str(out), "--report", str(report)]
    for o in overrides:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not report.exists():
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(report.read_text())


def mesh_sets(gpus: int) -> list[int]:
    return [n for n in (1, 2, 4, 8) if n <= gpus]


def section_generate(gpus: int, tmp: Path, limit: int = 2) -> None:
    spec = "specs/gpt_oss_120b.yaml" if gpus >= 8 else "specs/gpt_oss_20b.yaml"
    meshes = [[f"mesh.tp={gpus}"], [f"mesh.ep={gpus}", "mesh.tp=1"]] if gpus > 1 else [["mesh.tp=1"]]
    meshes = meshes[:limit]
    print(f"\n## generate: {spec}, random weights, {gpus} GPU(s)")
    print("| mesh | prefill tok/s | decode tok/s | peak GiB/GPU | plan GiB/GPU |")
    print("|---|---|---|---|---|")
    for overrides in meshes:
        r = run_one(spec, gpus, overrides + ["task.max_new_tokens=64"], tmp)
        if "error" in r:
            print(f"| {' '.join(overrides)} | failed: {r['error']} | | | |")
            continue
        speed = r["manifest"].get("speed") or {}
        print(f"| {' '.join(overrides)} | {speed.get('prefill_tokens_per_s', 0):,.0f} | "
              f"{speed.get('decode_tokens_per_s', 0):,.1f} | {r['peak_gib_per_gpu'] or 0:.2f} | "
              f"{r['plan_gib_per_gpu']:.2f} |")


def section_train(gpus: int, tmp: Path, steps: int) -> None:
    spec = "specs/gpt_oss_20b_train.yaml"
    half = max(gpus // 2, 1)
    meshes = [[f"mesh.fsdp={half}", f"mesh.ep={gpus // half}"], [f"mesh.fsdp={half}", f"mesh.tp={gpus // half}"]]
    print(f"\n## train step: {spec}, {gpus} GPU(s), {steps} steps")
    print("| mesh | tokens/s | step s | MFU | peak GiB/GPU | plan GiB/GPU |")
    print("|---|---|---|---|---|---|")
    shape = ["task.batch=8", "task.seq_len=4096"]
    if gpus < 8:  # 20b's fp32 master weights and Adam state need 8 GPUs; fewer GPUs train fewer layers
        shape = ["task.batch=4", "task.seq_len=2048", f"model.args.layers={3 * gpus}"]
        print(f"(fewer than 8 GPUs: {shape[-1]}, batch 4 × 2048)")
    tokens_per_step = int(shape[0].split("=")[1]) * int(shape[1].split("=")[1])
    for overrides in meshes:
        r = run_one(spec, gpus, overrides + [f"task.steps={steps}"] + shape, tmp)
        if "error" in r:
            print(f"| {' '.join(overrides)} | failed: {r['error']} | | | | |")
            continue
        tps = r["manifest"].get("tokens_per_s") or 0.0
        flops = (r["plan"]["flops"] or {}).get("train_step_per_token") or 0.0
        mfu = tps * flops / (989e12 * r["devices"]) if tps else 0.0
        step_s = tokens_per_step / tps if tps else float("nan")
        print(f"| {' '.join(overrides)} | {tps:,.0f} | {step_s:.3f} | {100 * mfu:.1f}% | "
              f"{r['peak_gib_per_gpu'] or 0:.2f} | {r['plan_gib_per_gpu']:.2f} |")


def _first_difference(a: list, b: list) -> str:
    """Where two per-step metric lists first differ, and their largest relative difference."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if not diff:
        return "identical"
    rel = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b) if x is not None and y is not None)
    return f"step {diff[0] + 1}, max rel {rel:.2e}"


def _trajectory(report: dict) -> tuple[list, list, str]:
    """A run's per-step losses and grad norms and its final parameters' checksum."""
    metrics = report["manifest"]["metrics"]
    return ([m.get("loss") for m in metrics], [m.get("grad_norm") for m in metrics],
            report["manifest"]["params_checksum"])


def section_determinism(gpus: int, tmp: Path, steps: int, fast: bool = True, limit: int = 0,
                        spec: str = "specs/gpt_oss_tiny.yaml", repeat: int = 1, extra: list[str] = (),
                        canonical_tp: int = 1, canonical_ep: int = 1) -> None:
    """Each mesh's deterministic run against the first (one GPU), and its step time against fast mode's on the same
    mesh; with repeat > 1 each configuration runs again in fresh processes (compiled again unless a persistent cache
    holds it), each compared with its first."""
    if canonical_tp > 1:  # every run with tp's canonical chunks (one GPU included): tp then splits the layers' compute
        extra = [*extra, f"parallel.canonical_tp={canonical_tp}"]
    if canonical_ep > 1:  # likewise ep's chunks of the experts
        extra = [*extra, f"parallel.canonical_ep={canonical_ep}"]
    base = [f"task.steps={steps}", "task.eval_every=0", "checkpoint.every=0", *extra]
    meshes = {1: [[]], 2: [["mesh.dp=2"], ["mesh.tp=2"], ["mesh.ep=2"], ["mesh.fsdp=2"], ["mesh.pp=2"]],
              4: [["mesh.dp=2", "mesh.tp=2"], ["mesh.fsdp=2", "mesh.ep=2"], ["mesh.tp=2", "mesh.ep=2"],
                  ["mesh.pp=2", "mesh.tp=2"]],
              8: [["mesh.dp=8"], ["mesh.fsdp=2", "mesh.tp=2", "mesh.ep=2"], ["mesh.pp=2", "mesh.tp=2", "mesh.ep=2"]]}

    print(f"\n## determinism: {spec} {' '.join(extra)}, {steps} steps, deterministic mode, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"(each configuration run {repeat} time(s) in fresh processes; 'again' compares the repeats with the "
          f"first: losses, grad norms and checksum all equal)" if repeat > 1 else "")
    print("| GPUs | mesh | loss vs 1 GPU | grad norm vs 1 GPU | checksum identical | again | tokens/s (det) | "
          "tokens/s (fast) | det step / fast step |")
    print("|---|---|---|---|---|---|---|---|---|")
    reference = None
    for n in mesh_sets(gpus):
        for overrides in meshes[n][:limit or None]:
            det = run_one(spec, n, base + overrides + ["parallel.deterministic=true"], tmp)
            # the cost of determinism: fast mode's collectives on the same mesh
            quick = run_one(spec, n, base + overrides + ["parallel.deterministic=false"], tmp) if fast else {}
            if "error" in det:
                print(f"| {n} | {' '.join(overrides) or '-'} | failed: {det['error']} | | | | | | |")
                continue
            losses, norms, checksum = _trajectory(det)
            reference = reference or (losses, norms, checksum)
            again = []
            for attempt in range(1, repeat):
                r = run_one(spec, n, base + overrides + ["parallel.deterministic=true"], tmp, attempt)
                again.append("failed" if "error" in r else
                             "identical" if _trajectory(r) == (losses, norms, checksum) else
                             f"differs ({_first_difference(_trajectory(r)[0], losses)} in the loss)")
            fast_tps = quick["manifest"].get("tokens_per_s") if "manifest" in quick else None
            det_tps = det["manifest"].get("tokens_per_s") or 0
            split = [f"{axis} splits" for k, axis in (("tensor", "tp"), ("experts", "ep"), ("pipeline", "pp"))
                     if (det["manifest"].get(k) or {}).get("split_compute")]
            label = " ".join(overrides) + (f" ({', '.join(split)})" if split else "")
            cost = f"{fast_tps / det_tps:.2f}x" if fast_tps and det_tps else "-"
            print(f"| {n} | {label or '-'} | {_first_difference(losses, reference[0])} | "
                  f"{_first_difference(norms, reference[1])} | {checksum == reference[2]} | "
                  f"{'; '.join(again) or '-'} | {det_tps:,.0f} | {fast_tps or 0:,.0f} | {cost} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="generate,train,determinism")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--generate-meshes", type=int, default=2, help="1: tensor parallel only; 2: also expert")
    parser.add_argument("--no-fast", action="store_true", help="determinism: skip the fast-mode comparison runs")
    parser.add_argument("--det-meshes", type=int, default=0, help="determinism: the first N meshes of each size")
    parser.add_argument("--det-spec", default="specs/gpt_oss_tiny.yaml", help="determinism: the spec trained")
    parser.add_argument("--repeat", type=int, default=1,
                        help="determinism: run each configuration this many times, in fresh processes")
    parser.add_argument("--det-set", action="append", default=[], help="determinism: an override of the spec")
    parser.add_argument("--canonical-tp", type=int, default=1,
                        help="determinism: parallel.canonical_tp for every run (tp meshes then split the compute)")
    parser.add_argument("--canonical-ep", type=int, default=1,
                        help="determinism: parallel.canonical_ep for every run (ep meshes then split the experts)")
    parser.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS for every configuration")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--report", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), args.xla_flags]).strip()
    if args.worker:
        worker(args.worker, args.overrides, args.out, args.report)
        return
    gpus = args.gpus or int(subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"],
                                           capture_output=True, text=True, check=True).stdout.strip())
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sections.split(","):
            if name == "generate":
                section_generate(gpus, Path(tmp), args.generate_meshes)
            elif name == "train":
                section_train(gpus, Path(tmp), args.steps)
            elif name == "determinism":
                section_determinism(gpus, Path(tmp), args.steps, fast=not args.no_fast, limit=args.det_meshes,
                                    spec=args.det_spec, repeat=args.repeat, extra=args.det_set,
                                    canonical_tp=args.canonical_tp, canonical_ep=args.canonical_ep)
            else:
                parser.error(f"unknown section {name!r}")


if __name__ == "__main__":
    main()
