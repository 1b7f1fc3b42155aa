"""Rewrites bench/RESULTS.md from one run on this machine's GPU: a table per suite, current numbers only.

    python -m bench.results [--only kernels,e2e] [--kernels attention,moe] [--e2e-rows NAME,..] [--out FILE]

Runs the whole programs of `python -m bench.e2e` (the rows `e2e.measure` returns, each in a process of its
own) and, in this process, the kernel groups of `python -m bench.kernels` (attention, moe, decode, mxfp4,
rmsnorm; the rows they leave in bench.timing.ROWS), then writes one markdown table per suite: case, implementation, time, rate,
Tessera / best peer, and on every row the device, jax version and commit (`+dirty` when the tree had
uncommitted changes). Rows of cases not run this time stay as they were.

Order matters on one card: the e2e rows' PyTorch peers and then the rows themselves run first, each in a
process of its own, while this process holds no device memory (a row takes the allocator `tessera run`
sets, and reads its own peak); then the kernel groups (PyTorch peers in this process, so JAX does not
preallocate). What was tried on each kernel, and why it stays or went: docs/kernels-log.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL_GROUPS = ("attention", "moe", "decode", "mxfp4", "rmsnorm", "fp8")
TITLES = {  # suite -> its section's heading, in the file's order
    "attention": "Attention: flash_attention (bench/suites/attention.py)",
    "moe": "MoE grouped GEMM (bench/suites/moe.py)",
    "decode": "Decode attention (bench/suites/decode.py)",
    "mxfp4": "MXFP4 expert matmul (bench/suites/mxfp4.py)",
    "rmsnorm": "RMSNorm (bench/suites/rms_norm.py)",
    "fp8": "fp8 GEMM (bench/suites/fp8.py)",
    "e2e": "Whole programs: `tessera run` (bench/e2e.py)",
}
HEADER = """# Benchmark results

Current numbers, one table per suite, written by `python -m bench.results` on a GPU machine: it runs
`bench.kernels`' groups (attention, moe, decode, mxfp4, rmsnorm) and `bench.e2e` in one process and
rewrites this file; a partial run (`--only e2e`, `--kernels decode`) rewrites the rows of the cases it
ran and keeps the others. Every row names the device, jax version and commit that measured it (`+dirty`:
the tree had uncommitted changes).
Rates count only the work needed (attention: visible pairs, backward 2.5x the forward; grouped GEMM:
real rows; decode and MXFP4: bytes read); "vs best peer" is Tessera's rate over the best other
implementation of the same case. What was tried on each kernel, and why it stays: docs/kernels-log.md.
"""
COLUMNS = ("case", "implementation", "time", "rate", "vs best peer", "device", "jax", "commit", "note")


def commit(repo: Path = ROOT) -> str:
    """The checkout's short commit hash, `+dirty` when tracked files differ from it; 'unknown' outside git.

    $BENCH_COMMIT, when set, is taken instead: for a copy of a working tree whose .git is not its own (a GPU
    machine that is sent the files), name the commit it was copied from."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def provenance() -> dict:
    """{device, jax, commit} of this run, for every row it writes."""
    import jax
    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "commit": commit()}


def kernel_rows(rows, prov: dict) -> list[dict]:
    """Table rows from bench.timing's (case, impl, ms, rate, unit) tuples, with Tessera / best peer."""
    from bench.timing import with_ratios
    return [dict(case=r[0], impl=r[1], ms=r[2] or None, rate=r[3], unit=r[4], ratio=ratio, **prov)
            for r, ratio in with_ratios(list(rows))]


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2 ** 30:.1f}"


def e2e_rows(rows: list[dict], prov: dict) -> list[dict]:
    """Table rows from bench.e2e.measure's rows: tokens/s or MFU, the measured PyTorch peers under their row."""
    out = []
    for r in rows:
        base = dict(case=r["row"], **prov)
        published = f"published: {r['peer']}" if r.get("peer", "-") != "-" else ""
        vs = r.get("vs_base")  # bench.e2e.against_base: a variant against its base row of the same run
        against = f"{vs['speedup']:.3f}x the speed of {vs['row']} (same run)" if vs else ""
        if "error" in r:
            out.append(dict(base, impl="tessera run", ms=None, rate=None, unit="", ratio=None,
                            note="; ".join(x for x in (f"FAILED: {r['error'][:160]}", published) if x)))
            continue
        mem = f"peak {_gib(r.get('peak_bytes'))} vs plan {_gib(r.get('planned_bytes'))} GiB"
        if r.get("kind") == "train":
            peers = [p for p in r.get("peers", []) if "error" not in p]
            best = min((p["step_ms"] for p in peers), default=None)
            for phase in ("forward", "train_step"):
                if phase + "_ms" in r:
                    mfu = r.get(phase + "_mfu")
                    out.append(dict(base, impl=f"tessera run, {phase.replace('_', ' ')}", ms=r[phase + "_ms"],
                                    rate=None if mfu is None else 100 * mfu, unit="% MFU",
                                    ratio=best / r["train_step_ms"] if best and phase == "train_step" else None,
                                    note="; ".join(x for x in (mem, published) if x) if phase == "forward"
                                    else against))
            flops, peak = r.get("train_step_flops_per_token"), r.get("peak_flops")
            for p in r.get("peers", []):
                if "error" in p:
                    out.append(dict(base, impl=p["peer"], ms=None, rate=None, unit="", ratio=None,
                                    note=f"FAILED: {p['error'][:160]}"))
                elif flops and peak:
                    out.append(dict(base, impl=p["peer"], ms=p["step_ms"], rate=100 * p["tokens_per_s"] * flops / peak,
                                    unit="% MFU", ratio=None, note="train step; MFU counted with Tessera's FLOPs"))
                else:
                    out.append(dict(base, impl=p["peer"], ms=p["step_ms"], rate=p["tokens_per_s"], unit="tok/s",
                                    ratio=None, note="train step"))
            continue
        first = r.get("first_token_s")
        detail = [f"first token {first * 1e3:.1f} ms" if first is not None else "",
                  f"compile {r['compile_s']:.1f} s" if r.get("compile_s") is not None else "", mem, against, published]
        if r.get("kind") == "prefill":
            out.append(dict(base, impl="tessera run, prefill", ms=None if first is None else first * 1e3,
                            rate=r["prefill_tok_s"], unit="tok/s", ratio=None,
                            note="; ".join(x for x in detail if x)))
            continue
        share = (f"{r['roofline_share']:.0%} of the {r['roofline_tok_s']:,.0f} tok/s roofline"
                 if r.get("roofline_share") else "")
        prefill = f"prefill {r['prefill_tok_s']:,.0f} tok/s" if r.get("prefill_tok_s") else ""
        peers = [p for p in r.get("peers", []) if "error" not in p]
        best = max((p["tokens_per_s"] for p in peers), default=None)
        out.append(dict(base, impl="tessera run, decode", ms=1e3 * r.get("batch", 1) / r["decode_tok_s"],
                        rate=r["decode_tok_s"], unit="tok/s", ratio=r["decode_tok_s"] / best if best else None,
                        note="; ".join(x for x in [share, prefill] + detail if x)))
        for p in r.get("peers", []):
            if "error" in p:
                out.append(dict(base, impl=p["peer"], ms=None, rate=None, unit="", ratio=None,
                                note=f"FAILED: {p['error'][:160]}"))
            else:
                first = p.get("first_token_s")
                out.append(dict(base, impl=p["peer"], ms=p["step_ms"], rate=p["tokens_per_s"], unit="tok/s",
                                ratio=None, note=f"first token {first * 1e3:.1f} ms" if first else ""))
    return out


def _time(ms) -> str:
    if ms is None:
        return "-"
    return f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:,.3f} ms" if ms < 100 else f"{ms:,.1f} ms"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(rows: list[dict]) -> str:
    """One markdown table of `rows` (dicts of case, impl, ms, rate, unit, ratio, device, jax, commit, note)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        rate = "-" if r.get("rate") is None else f"{r['rate']:,.1f} {r['unit']}".strip()
        ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else ""
        cells = (r["case"], r["impl"], _time(r.get("ms")), rate, ratio, r["device"], r["jax"], r["commit"],
                 r.get("note", ""))
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def sections_of(text: str) -> dict[str, str]:
    """{heading: its section's text, heading line included} of a file written by `write`."""
    parts = re.split(r"(?m)^(?=## )", text)
    return {p.splitlines()[0][3:].strip(): p.rstrip("\n") + "\n" for p in parts if p.startswith("## ")}


def note_of(text: str) -> str:
    """The note of a file written by `write`: its quoted ("> ") lines before the first section."""
    head = re.split(r"(?m)^## ", text, maxsplit=1)[0]
    return "\n".join(line[2:] for line in head.splitlines() if line.startswith("> "))


def _body(section: str) -> list[str]:
    """A section's table rows (the lines after its |---| line)."""
    lines = section.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("|---")), len(lines))
    return [line for line in lines[start:] if line.startswith("| ")]


def render(measured: dict[str, list[dict]], kept: dict[str, str] | None = None, note: str | None = None,
           kept_note: str = "") -> str:
    """The file: the header, then each suite of TITLES in order. A measured suite's table holds its new rows,
    then the rows `kept` has for cases not measured now; a suite not measured keeps its section, and so does
    a section of `kept` that is no suite's (written by hand), after the suites. `note`
    (None: `kept_note`, while any old row is kept) follows the header."""
    kept, sections, carried = kept or {}, [], 0
    for suite, title in TITLES.items():
        if suite in measured:
            cases = {r["case"] for r in measured[suite]}
            old = [line for line in _body(kept.get(title, "")) if line[2:].split(" | ", 1)[0] not in cases]
            carried += len(old)
            sections.append(f"## {title}\n\n{table(measured[suite])}" + "".join(line + "\n" for line in old))
        elif title in kept:
            carried += len(_body(kept[title]))
            sections.append(kept[title])
    # sections no suite writes (measured by hand: the scientific models) stay, after the suites, in order
    sections += [text for title, text in kept.items() if title not in TITLES.values()]
    note = (kept_note if carried else "") if note is None else note
    quoted = "".join(f"> {line}\n" for line in note.strip().splitlines()) if note else ""
    return "\n".join([HEADER + (f"\n{quoted}" if quoted else "")] + sections)


def write(path, measured: dict[str, list[dict]], note: str | None = None) -> str:
    """Write the file at `path` (render), keeping from what is there the rows and sections not measured now;
    returns the text."""
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    text = render(measured, sections_of(old), note, note_of(old))
    path.write_text(text)
    return text


def _run_kernel_groups(groups, prov) -> dict[str, list[dict]]:
    from bench import timing
    from bench.kernels import GROUPS
    measured = {}
    for group in groups:
        start = len(timing.ROWS)
        print(f"== bench.kernels --only {group}", flush=True)
        try:
            GROUPS[group]()
        except Exception as exc:  # one failing group (a peer missing here) must not lose the others' rows
            print(f"  group {group} failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        if len(timing.ROWS) > start:
            measured[group] = kernel_rows(timing.ROWS[start:], prov)
    return measured


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="kernels,e2e", help="parts, comma-separated: kernels, e2e")
    ap.add_argument("--kernels", default=",".join(KERNEL_GROUPS),
                    help=f"kernel groups to run, comma-separated (of {', '.join(KERNEL_GROUPS)})")
    ap.add_argument("--e2e-rows", default=None, help="bench.e2e row names, comma-separated (default: all)")
    ap.add_argument("--no-peers", action="store_true", help="skip the e2e rows' PyTorch peers")
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"), help="the file to rewrite")
    args = ap.parse_args(argv)
    parts = set(args.only.split(","))
    if not parts <= {"kernels", "e2e"}:
        ap.error(f"--only takes kernels and/or e2e, got {args.only}")
    groups = [g for g in args.kernels.split(",") if g]
    if not set(groups) <= set(KERNEL_GROUPS):
        ap.error(f"--kernels takes {', '.join(KERNEL_GROUPS)}, got {args.kernels}")
    from bench import e2e

    try:
        names = e2e.select(rows=args.e2e_rows) if "e2e" in parts else []
    except ValueError as exc:
        ap.error(str(exc))
    measured = {}
    if names:  # first, while this process holds no device memory: each row runs in a process of its own
        peers = {} if args.no_peers else e2e.measure_peers(names)
        rows = e2e.measure(names, peers)
        done = next((r for r in rows if "device" in r), {})
        prov = {"device": done.get("device", "-"), "jax": done.get("jax", "-"), "commit": commit()}
        measured["e2e"] = e2e_rows(rows, prov)
    if "kernels" in parts:
        # JAX grows to what it needs instead of taking 95 % of the card: the PyTorch peers share it
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        prov = provenance()
        print(f"# {prov['device']}, jax {prov['jax']}, commit {prov['commit']}", flush=True)
        measured.update(_run_kernel_groups(groups, prov))
    write(args.out, measured)
    print(f"wrote {args.out}: {', '.join(measured) or 'no suite'} measured", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
