"""One spec run at several commits, each commit's own code in a process of its own: a speed regression bisected in
one GPU call.

    here, where git is:   python -m bench.across_commits export d4cc6d1 5dbef59 HEAD
    on the GPU machine:   python -m bench.across_commits run specs/bench/gpt_oss_20b_layers_train.yaml \\
                              --set parallel.deterministic=true [--timeout 200] [--tail 6]

`export` writes each commit's tessera/, specs/ and models/ (`git archive`) under .commits/<short hash>/ (ignored by
git: name `.commits` in the device call's `carry`). `run` runs `python -m tessera.cli run SPEC --set ...` from each
exported tree in the order exported, one process each with that commit's own modules, specs and models (a spec
that differs between the commits runs as each wrote it), and prints each run's last `--tail` lines under its commit
and wall time. Nothing is shared between the processes but the machine's compilation and autotuning caches, which
key on the program (set TESSERA_COMPILATION_CACHE=off to compile each afresh).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / ".commits"
TREES = ("tessera", "specs", "models")


def export(commits: list[str], store: Path = STORE) -> list[Path]:
    """Each commit's TREES under store/<short hash>/, in order (store/ORDER lists them)."""
    done = []
    for commit in commits:
        short = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, check=True, capture_output=True,
                               text=True).stdout.strip()
        where = store / short
        where.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", short, *TREES], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
        done.append(where)
    (store / "ORDER").write_text("".join(f"{p.name}\n" for p in done))
    return done


def run(spec: str, overrides: list[str], timeout: int, tail: int) -> int:
    """`tessera run spec` from each exported tree; 0 when every one ended well."""
    order = (STORE / "ORDER").read_text().split() if (STORE / "ORDER").exists() else []
    if not order:
        print(f"nothing exported under {STORE}: run `python -m bench.across_commits export COMMIT ...` first")
        return 2
    failed = 0
    for short in order:
        tree = STORE / short
        argv = [sys.executable, "-m", "tessera.cli", "run", spec, *[a for o in overrides for a in ("--set", o)]]
        # cwd first on the path: this commit's tessera, not the checkout's (PYTHONPATH keeps the machine's wheels)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
        start = time.perf_counter()
        try:
            proc = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
            out, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out, rc = (exc.stdout or b"").decode() + (exc.stderr or b"").decode(), "timeout"
        failed += rc != 0
        lines = [line for line in out.splitlines() if line.strip()]
        print(f"== {short}: rc {rc}, {time.perf_counter() - start:.0f} s", flush=True)
        print("\n".join(f"   {line}" for line in lines[-tail:]), flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verbs = ap.add_subparsers(dest="verb", required=True)
    ex = verbs.add_parser("export", help="write each commit's trees under .commits/")
    ex.add_argument("commits", nargs="+")
    rn = verbs.add_parser("run", help="tessera run SPEC at each exported commit")
    rn.add_argument("spec", help="the spec's path inside each commit's tree, e.g. specs/gpt_oss_20b.yaml")
    rn.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    rn.add_argument("--timeout", type=int, default=300, help="seconds a commit's run may take")
    rn.add_argument("--tail", type=int, default=6, help="lines of each run's output printed")
    args = ap.parse_args(argv)
    if args.verb == "export":
        for where in export(args.commits):
            print(where.relative_to(ROOT))
        return 0
    return run(args.spec, args.set, args.timeout, args.tail)


if __name__ == "__main__":
    raise SystemExit(main())
